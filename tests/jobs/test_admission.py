"""Admission against the real (test) Redis: slots, the queue, leases and the sweep."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.utils import timezone

from apps.jobs import admission
from apps.jobs.jobs import job_complete
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model
from racon import ids
from racon.ids import DeploymentId, JobId, ModelId
from racon.redis import get_redis
from tests.factories import DeploymentFactory, JobFactory, ModelFileFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def model() -> Model:
    return ModelFileFactory(
        model__name="adm-model", file_name="m.gguf", sha256="c" * 64, size=1000, n_layer=0
    ).model


def deployment(
    model: Model, *, n_parallel: int = 1, state: str = DeploymentState.READY
) -> Deployment:
    node = NodeFactory()
    dep = DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        state=state,
        primary=node,
        n_parallel=n_parallel,
        plan={
            "primary_node_id": str(node.id),
            "devices": [
                {"node_id": str(node.id), "device": "CPU", "layer_start": 0, "layer_end": 30}
            ],
        },
    )
    dep.nodes.set([node])
    return dep


def admission_keys() -> list[str]:
    r = get_redis()
    return sorted(
        k
        for pattern in ("racon:dep:*:slots", "racon:dep:*:waiting", "racon:dep:*:waitlease")
        for k in r.scan_iter(match=pattern)
    )


def test_a_slot_is_taken_up_to_n_parallel_and_release_is_idempotent() -> None:
    dep = DeploymentId("d1")
    assert admission.slot_try(deployment_id=dep, job_id=JobId("a"), cap=2)
    assert admission.slot_try(deployment_id=dep, job_id=JobId("b"), cap=2)
    assert not admission.slot_try(deployment_id=dep, job_id=JobId("c"), cap=2)
    assert admission.slots_in_use([dep]) == {dep: 2}
    admission.slot_release(deployment_id=dep, job_id=JobId("a"))
    admission.slot_release(deployment_id=dep, job_id=JobId("a"))
    assert admission.slots_in_use([dep]) == {dep: 1}
    assert admission.slot_try(deployment_id=dep, job_id=JobId("c"), cap=2)
    assert admission.slots_in_use([dep]) == {dep: 2}


def test_a_newcomer_never_passes_a_waiter_but_takes_slots_the_queue_cannot_fill() -> None:
    dep = DeploymentId("d1")
    assert admission.slot_try(deployment_id=dep, job_id=JobId("running"), cap=2)
    assert admission.slot_try(deployment_id=dep, job_id=JobId("running-2"), cap=2)
    assert admission.queue_join(deployment_id=dep, job_id=JobId("waiter"), priority=1.0)
    admission.slot_release(deployment_id=dep, job_id=JobId("running"))
    # One slot free, one waiter: the newcomer would pass it.
    assert not admission.slot_try(deployment_id=dep, job_id=JobId("newcomer"), cap=2)
    assert admission.slot_try(deployment_id=dep, job_id=JobId("waiter"), cap=2)
    assert admission.queue_order(deployment_id=dep) == []
    # Two slots free, one waiter: both fit, so the newcomer goes in at once.
    admission.slot_release(deployment_id=dep, job_id=JobId("running-2"))
    admission.slot_release(deployment_id=dep, job_id=JobId("waiter"))
    assert admission.queue_join(deployment_id=dep, job_id=JobId("waiter-2"), priority=1.0)
    assert admission.slot_try(deployment_id=dep, job_id=JobId("newcomer"), cap=2)


def test_the_queue_is_served_lowest_score_first() -> None:
    dep = DeploymentId("d1")
    assert admission.slot_try(deployment_id=dep, job_id=JobId("running"), cap=1)
    for job, score in (("late-rich", 90.0), ("early-poor", 100.0), ("mid", 95.0)):
        assert admission.queue_join(deployment_id=dep, job_id=JobId(job), priority=score)
    assert admission.queue_order(deployment_id=dep) == [
        "late-rich",
        "mid",
        "early-poor",
    ]
    admission.slot_release(deployment_id=dep, job_id=JobId("running"))
    assert not admission.slot_try(deployment_id=dep, job_id=JobId("early-poor"), cap=1)
    assert admission.slot_try(deployment_id=dep, job_id=JobId("late-rich"), cap=1)


def test_a_full_queue_refuses_a_new_waiter(settings: Any) -> None:
    settings.JOB_QUEUE_MAX = 2
    for job in ("a", "b"):
        assert admission.queue_join(
            deployment_id=DeploymentId("d1"), job_id=JobId(job), priority=1.0
        )
    assert not admission.queue_join(
        deployment_id=DeploymentId("d1"), job_id=JobId("c"), priority=1.0
    )
    assert admission.queue_join(
        deployment_id=DeploymentId("d1"), job_id=JobId("a"), priority=1.0
    )  # already in: a renewal
    assert admission.queue_depth(["d1"]) == {"d1": 2}


def test_a_lapsed_waiter_never_holds_the_head_of_the_queue() -> None:
    dep = DeploymentId("d1")
    long_ago = time.time() - 3600
    assert admission.queue_join(
        deployment_id=dep, job_id=JobId("crashed-view"), priority=0.0, now=long_ago
    )
    assert admission.queue_depth([dep]) == {dep: 0}
    assert admission.slot_try(deployment_id=dep, job_id=JobId("next"), cap=1)
    assert admission.queue_order(deployment_id=dep) == []


def test_an_expired_slot_lease_is_a_crashed_views_slot_and_is_taken_back() -> None:
    dep = DeploymentId("d1")
    long_ago = time.time() - 3600
    assert admission.slot_try(deployment_id=dep, job_id=JobId("crashed-view"), cap=1, now=long_ago)
    assert admission.slots_in_use([dep]) == {dep: 0}
    assert admission.slot_try(deployment_id=dep, job_id=JobId("next"), cap=1)


def test_renewing_extends_a_held_lease_only() -> None:
    dep = DeploymentId("d1")
    soon = time.time() - admission.slot_lease_seconds() + 1
    assert admission.slot_try(deployment_id=dep, job_id=JobId("a"), cap=1, now=soon)
    assert admission.slot_renew(deployment_id=dep, job_id=JobId("a"))
    assert (
        get_redis().zscore(admission.slots_key(dep), "a")
        > time.time() + admission.slot_lease_seconds() - 5
    )
    assert not admission.slot_renew(deployment_id=dep, job_id=JobId("not-held"))
    assert get_redis().zscore(admission.slots_key(dep), "not-held") is None


def test_the_sweep_reclaims_a_crashed_views_slot_lease_and_slots_of_finished_jobs(
    model: Model,
) -> None:
    dep = deployment(model, n_parallel=4)
    now = timezone.now()
    running = JobFactory(model=model, deployment=dep, state=JobState.RUNNING, queued_at=now)
    finished = JobFactory(model=model, deployment=dep, state=JobState.COMPLETED, queued_at=now)
    crashed = JobFactory(model=model, deployment=dep, state=JobState.RUNNING, queued_at=now)
    not_yet_written = uuid.uuid4()  # the fast path takes a slot before the job row exists
    t = time.time()
    for job in (running, finished, not_yet_written):
        assert admission.slot_try(
            deployment_id=ids.deployment_id(dep.id),
            job_id=ids.job_id(job if isinstance(job, uuid.UUID) else job.id),
            cap=4,
            now=t,
        )
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=ids.job_id(crashed.id), cap=4, now=t - 3600
    )
    counts = admission.admission_sweep(now=t + 1)
    assert counts["slots_expired"] == 1 and counts["slots_finished"] == 1
    held = set(get_redis().zrange(admission.slots_key(ids.deployment_id(dep.id)), 0, -1))
    assert held == {str(running.id), str(not_yet_written)}


def test_the_sweep_drops_lapsed_waiters_and_keeps_live_ones(model: Model) -> None:
    dep = deployment(model)
    t = time.time()
    assert admission.queue_join(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("live"), priority=2.0, now=t
    )
    assert admission.queue_join(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("lapsed"), priority=1.0, now=t - 3600
    )
    get_redis().zadd(
        admission.waiting_key(ids.deployment_id(dep.id)), {"no-lease": 0.5}
    )  # an entry that never had a lease
    counts = admission.admission_sweep(now=t + 1)
    assert counts["waiters_dropped"] == 2
    assert admission.queue_order(deployment_id=ids.deployment_id(dep.id)) == ["live"]
    assert get_redis().zrange(admission.waitlease_key(ids.deployment_id(dep.id)), 0, -1) == ["live"]


def test_a_finished_job_gives_its_slot_back(model: Model) -> None:
    dep = deployment(model)
    job = JobFactory(model=model, deployment=dep, state=JobState.RUNNING)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=ids.job_id(job.id), cap=1
    )
    assert job_complete(
        job_id=ids.job_id(job.id), usage={}, finish_reason="stop", chunks=0, now=timezone.now()
    )
    assert admission.slots_in_use([dep.id]) == {str(dep.id): 0}
    assert admission_keys() == []


# --- waiting -----------------------------------------------------------------------------------


async def wait(dep: Deployment, job: str, priority: float = 1.0, **kw: Any) -> None:
    await admission.wait_for_slot(
        deployment_id=ids.deployment_id(dep.id),
        job_id=JobId(job),
        model_id=ids.model_id(dep.model_id),
        priority=priority,
        load_timeout=kw.pop("load_timeout", 30.0),
        slot_timeout=kw.pop("slot_timeout", 30.0),
        **kw,
    )


def test_a_cancelled_waiter_leaves_the_queue_at_once(model: Model) -> None:
    dep = deployment(model)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"), cap=1
    )

    async def run() -> tuple[list[str], list[str]]:
        waiters = [
            asyncio.ensure_future(wait(dep, f"gives-up-{k}", priority=float(k))) for k in range(3)
        ]
        for _ in range(200):
            if len(admission.queue_order(deployment_id=ids.deployment_id(dep.id))) == 3:
                break
            await asyncio.sleep(0.01)
        queued = admission.queue_order(deployment_id=ids.deployment_id(dep.id))
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return queued, admission.queue_order(deployment_id=ids.deployment_id(dep.id))

    queued, after = async_to_sync(run)()
    assert queued == ["gives-up-0", "gives-up-1", "gives-up-2"]
    assert after == []
    admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"))
    assert admission_keys() == []
    # The waiters' time in the queue was recorded for the autoscaler.
    assert admission.model_queue_wait(ids.model_id(model.id)) > 0.0
    assert admission.model_last_queued(ids.model_id(model.id)) is not None


def test_a_waiter_gets_the_slot_when_it_frees_and_the_queue_is_served_in_order(
    model: Model,
) -> None:
    dep = deployment(model)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"), cap=1
    )
    served: list[str] = []

    async def waiter(job: str, priority: float) -> None:
        await wait(dep, job, priority=priority)
        served.append(job)

    async def run() -> None:
        tasks = [
            asyncio.ensure_future(waiter(job, p))
            for job, p in (("poor", 3.0), ("rich", 1.0), ("middle", 2.0))
        ]
        for _ in range(200):
            if len(admission.queue_order(deployment_id=ids.deployment_id(dep.id))) == 3:
                break
            await asyncio.sleep(0.01)
        holder = "running"
        for _ in range(3):
            admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId(holder))
            before = len(served)
            for _ in range(500):
                if len(served) > before:
                    break
                await asyncio.sleep(0.01)
            holder = served[-1]
        await asyncio.gather(*tasks)
        admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId(holder))

    async_to_sync(run)()
    assert served == ["rich", "middle", "poor"]
    assert admission_keys() == []
    assert admission.model_queue_depth(ids.model_id(model.id)) == 0


def test_a_timed_out_waiter_leaves_the_queue_and_a_stopped_deployment_ends_the_wait(
    model: Model,
) -> None:
    dep = deployment(model)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"), cap=1
    )
    with pytest.raises(admission.WaitTimedOut):
        async_to_sync(wait)(dep, "impatient", slot_timeout=0.2)
    assert admission.queue_order(deployment_id=ids.deployment_id(dep.id)) == []
    Deployment.objects.filter(pk=dep.pk).update(state=DeploymentState.STOPPED)
    with pytest.raises(admission.DeploymentUnavailable):
        async_to_sync(wait)(dep, "too-late")
    assert admission.queue_order(deployment_id=ids.deployment_id(dep.id)) == []


def test_a_waiter_queues_while_the_deployment_loads(model: Model) -> None:
    dep = deployment(model, state=DeploymentState.LOADING)

    async def run() -> bool:
        task = asyncio.ensure_future(wait(dep, "early"))
        for _ in range(200):
            if admission.queue_depth([dep.id])[str(dep.id)] == 1:
                break
            await asyncio.sleep(0.01)
        await sync_to_async(
            lambda: Deployment.objects.filter(pk=dep.pk).update(state=DeploymentState.READY)
        )()
        await asyncio.wait_for(task, timeout=30)
        return True

    assert async_to_sync(run)()
    assert get_redis().zrange(admission.slots_key(ids.deployment_id(dep.id)), 0, -1) == ["early"]
    assert admission.queue_order(deployment_id=ids.deployment_id(dep.id)) == []


def test_the_queue_wait_ewma_decays_while_nobody_waits() -> None:
    t = time.time()
    admission.queue_wait_record(model_id=ModelId("m1"), seconds=10.0, now=t)
    assert admission.model_queue_wait(ModelId("m1"), now=t) == pytest.approx(10.0)
    admission.queue_wait_record(model_id=ModelId("m1"), seconds=0.0, now=t)
    assert admission.model_queue_wait(ModelId("m1"), now=t) == pytest.approx(
        10.0 * (1 - admission.WAIT_EWMA_ALPHA)
    )
    later = t + admission.WAIT_HALF_LIFE_SECONDS
    assert admission.model_queue_wait(ModelId("m1"), now=later) == pytest.approx(
        10.0 * (1 - admission.WAIT_EWMA_ALPHA) / 2
    )
    assert admission.model_queue_wait(ModelId("unknown")) == 0.0
