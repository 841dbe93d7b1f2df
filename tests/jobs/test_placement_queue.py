"""Placement never blocks the controller's periodic work: it has its own queue and worker.

Real Celery workers (subprocesses) on the test database and Redis, set up as the launcher starts
them: a default worker and a placement worker (-Q, concurrency 4). Four placements stall (their
nodes' command queues are read by nobody, so each waits on BLPOP until MODEL_FETCH_TIMEOUT);
meanwhile a health sweep and a settlement, sent to the default queue, still run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from agent.protocol import HEARTBEATS_ZSET
from apps.credits.models import Entry, EntryKind
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from apps.nodes.models import Node
from apps.nodes.states import NodeState
from racon.celery import app
from racon.redis import get_redis
from tests.e2e.harness import BIN, ROOT, database_url
from tests.factories import (
    DeploymentFactory,
    NodeFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)
from tests.support.processes import free_port, stop, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings(
        "ignore:task_always_eager has no effect on send_task"
    ),  # meant: the real workers run them
]
GiB = 1024**3
STALL_SECONDS = 120  # each stalled placement's wait (MODEL_FETCH_TIMEOUT in the workers)


def test_placement_tasks_are_routed_to_their_own_queue_with_time_limits() -> None:
    route = app.amqp.router.route
    for name in ("racon.jobs.place_deployment", "racon.jobs.speed_challenge"):
        assert route({}, name)["queue"].name == settings.CELERY_PLACEMENT_QUEUE
        assert (
            0
            < settings.CELERY_TASK_ANNOTATIONS[name]["soft_time_limit"]
            < settings.CELERY_TASK_ANNOTATIONS[name]["time_limit"]
        )
    for name in (
        "racon.nodes.health_sweep",
        "racon.credits.settle_job",
        "racon.jobs.stale_jobs_sweep",
    ):
        assert route({}, name)["queue"].name == settings.CELERY_TASK_DEFAULT_QUEUE
    assert settings.CELERY_PLACEMENT_QUEUE != settings.CELERY_TASK_DEFAULT_QUEUE


def _worker(
    env: dict[str, str], queue: str, name: str, concurrency: int, log: Path
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                str(BIN / "celery"),
                "-A",
                "racon",
                "worker",
                "-l",
                "info",
                "--concurrency",
                str(concurrency),
                "-n",
                f"{name}@%h",
                "-Q",
                queue,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[str, str, list[subprocess.Popen[bytes]]]]:
    port = free_port()  # only a unique name: the queues of one test Redis are shared
    default_q, placement_q = f"racon-pq-{port}", f"racon-pq-{port}.placement"
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "CELERY_TASK_DEFAULT_QUEUE": default_q,
        "CELERY_PLACEMENT_QUEUE": placement_q,
        "MODEL_FETCH_TIMEOUT": str(STALL_SECONDS),
        "RACON_VAR_DIR": str(tmp_path / "var"),
        "SECRET_KEY": "placement-queue-test-" + "k" * 40,
        "DEBUG": "false",
        "API_CACHE_SECONDS": "0",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    procs = [
        _worker(env, default_q, f"pq-default-{port}", 1, tmp_path / "default.log"),
        _worker(env, placement_q, f"pq-placement-{port}", 4, tmp_path / "placement.log"),
    ]
    try:
        yield default_q, placement_q, procs
    finally:
        for p in procs:
            stop(p, signal.SIGKILL, timeout=10)
        get_redis().delete(default_q, placement_q)
        logs = "".join(
            p.read_text(errors="replace")[-2000:] for p in sorted(tmp_path.glob("*.log"))
        )
        print(logs)  # shown by pytest on failure


def test_four_stalled_placements_leave_the_health_sweep_and_settlement_on_time(
    model: Model, workers: tuple[str, str, list[subprocess.Popen[bytes]]]
) -> None:
    default_q, placement_q, procs = workers
    r = get_redis()
    now = time.time()
    # Four nodes whose queues nobody reads: a placement on each waits for a model transfer.
    stalled_nodes = [
        NodeFactory(
            name=f"silent-{i}", state=NodeState.READY, ram_total=16 * GiB, ram_available=16 * GiB
        )
        for i in range(4)
    ]
    late = NodeFactory(name="late", state=NodeState.READY)
    r.zadd(
        HEARTBEATS_ZSET, {str(n.id): now + 3600 for n in stalled_nodes}
    )  # fresh for the whole test
    r.zadd(
        HEARTBEATS_ZSET, {str(late.id): now - 3600}
    )  # silent for an hour: the sweep takes it OFFLINE
    deps = [
        DeploymentFactory(
            model=model,
            model_file=model.files.get(),
            state=DeploymentState.PLANNING,
            primary=None,
            request={"n_ctx": 512, "pin_nodes": [str(n.id)]},
        )
        for n in stalled_nodes
    ]
    # A finished job waiting for its settlement.
    payer = funded_account(1_000_000)
    job = job_for(
        account=payer,
        model=model,
        deployment=deployment_for([(NodeFactory(name="earner"), 10)], model=model),
    )
    job_finish(job, completion=10)

    for dep in deps:
        app.send_task(
            "racon.jobs.place_deployment", kwargs={"deployment_id": str(dep.id)}, queue=placement_q
        )

    def all_stalled() -> bool:
        for p in procs:
            assert p.poll() is None, f"a worker exited with {p.returncode}"
        states = set(
            Deployment.objects.filter(pk__in=[d.pk for d in deps]).values_list("state", flat=True)
        )
        assert DeploymentState.FAILED not in states, Deployment.objects.filter(
            pk__in=[d.pk for d in deps]
        ).values_list("error", flat=True)
        return states == {DeploymentState.LOADING}

    # Every placement slot is taken: four placements wait on agents that never answer.
    wait_for(all_stalled, 90, "four placements stalled in LOADING")
    app.send_task("racon.nodes.health_sweep", queue=default_q)
    app.send_task("racon.credits.settle_job", kwargs={"job_id": str(job.id)}, queue=default_q)

    def periodic_work_done() -> Any:
        swept = Node.objects.get(pk=late.pk).state == NodeState.OFFLINE
        settled = Entry.objects.filter(kind=EntryKind.SETTLE, job=job).exists()
        return swept and settled

    # Generous bound (the stalls last STALL_SECONDS); the order is what matters: both finished
    # while every placement was still waiting on its agent.
    wait_for(periodic_work_done, STALL_SECONDS * 0.75, "the health sweep and the settlement to run")
    assert set(
        Deployment.objects.filter(pk__in=[d.pk for d in deps]).values_list("state", flat=True)
    ) == {DeploymentState.LOADING}
    assert timezone.now().timestamp() - now < STALL_SECONDS
