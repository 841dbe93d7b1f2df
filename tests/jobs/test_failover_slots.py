"""A failed-over attempt is pinned to a llama-server slot on its new replica (apps/jobs/serving.py,
job_failover; kvcache.slot_claim / slot_release), so the KV coordinator never hands that slot to
another job.

Found by the real-agent pause test: the failover dispatched attempt 2 with no ``id_slot`` and no
pin in the new replica's busy hash, so the next job admitted there was pinned to the very slot the
attempt ran on, and produced nothing for 60 s. Here a real failover runs through the stream
follower and serving.job_failover under the ``prefix`` routing policy, against the real database
and Redis, with the agents played at the Redis edge (FakeAgents): attempt 1's primary dies after
one chunk (the agent's ``primary_died`` error entry), attempt 2 runs on the other deployment.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from agent.protocol import job_stream_key
from agent.runtime.stream import entry
from apps.jobs import kvcache, serving
from apps.jobs.models import Deployment, Job
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model
from apps.nodes.models import Node
from racon.redis import get_redis
from tests.factories import DeploymentFactory, NodeFactory
from tests.jobs.helpers import placeable_model
from tests.support.fake_agents import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the follower's steps run on the thread pool

FIRST_TOKEN, SECOND_TOKEN = 11, 12


class RunJobAgents(FakeAgents):
    """FakeAgents that also run jobs as an agent would write their streams: attempt 1 of the
    first job dies after one chunk (llama-server exited under it), any later attempt writes one
    chunk and keeps running; every run_job payload is kept, in order, for the test to read."""

    def __init__(self, node_ids: list[str]) -> None:
        super().__init__(node_ids)
        self.run_jobs: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.dying_job: str | None = None

    def answer(self, node_id: str, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["kind"] == "run_job":
            payload = cmd["payload"]
            with self.lock:
                self.run_jobs.append((node_id, payload))
                if self.dying_job is None:
                    self.dying_job = payload["job_id"]
            self._write(node_id, payload)
        return super().answer(node_id, cmd)

    def _write(self, node_id: str, payload: dict[str, Any]) -> None:
        job_id, attempt = payload["job_id"], int(payload.get("attempt") or 1)
        key = job_stream_key(job_id, node_id)
        r = get_redis()
        if attempt == 1 and job_id == self.dying_job:
            r.xadd(key, entry(0, "chunk", "a", ids=[FIRST_TOKEN], attempt=1))
            r.xadd(
                key,
                entry(1, "error", "the primary process exited", "error", code="primary_died"),
            )
        elif attempt > 1:
            r.xadd(key, entry(0, "chunk", "b", ids=[SECOND_TOKEN], attempt=attempt))

    def payloads(self, job_id: str, *, at_least: int = 1) -> list[tuple[str, dict[str, Any]]]:
        """The job's run_job commands (node, payload), once this thread has taken ``at_least`` of
        them off the queues (it answers them asynchronously); fewer after a generous bound."""
        deadline = time.monotonic() + 30
        while True:
            with self.lock:
                got = [(n, p) for n, p in self.run_jobs if p["job_id"] == job_id]
            if len(got) >= at_least or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


@pytest.fixture
def model(tmp_path: Path) -> Model:
    return placeable_model(
        name="failover-slots-model",
        sha256="f" * 64,
        store=tmp_path / "store-m.gguf",
        store_bytes=2**20,
    )


def small_node() -> Node:
    """A READY node too small for any new placement: the dead replica's automatic replacement is
    refused at once, so the failover goes to the one other serving deployment, deterministically."""
    node = NodeFactory(ram_total=1, ram_available=1)
    node.hardware["memory"] = {"total": 1, "available": 1}
    node.save()
    return node


def serving_deployment(model: Model, node: Node) -> Deployment:
    dep = DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        state=DeploymentState.READY,
        primary=node,
        n_parallel=2,
        n_ctx=2048,
        request={"n_ctx": 2048, "n_parallel": 2},
        plan={
            "primary_node_id": str(node.id),
            "devices": [
                {"node_id": str(node.id), "device": "CPU", "layer_start": 0, "layer_end": 30}
            ],
        },
        ready_at=timezone.now(),
    )
    dep.nodes.set([node])
    return dep


def admit(model: Model, text: str) -> serving.Admission:
    return serving.admission_open(
        model_name=model.name,
        account_id=None,
        api_key_id=None,
        kind="chat",
        params={"messages": [{"role": "user", "content": text}]},
        max_tokens=16,
        stream=True,
        request_id=f"req-{text}",
        hold=None,
        now=timezone.now(),
    )


def busy(deployment_id: Any) -> dict[str, str]:
    """The KV coordinator's pins on the deployment: slot → job id."""
    return {
        str(k): str(v) for k, v in get_redis().hgetall(kvcache.dep_busy_key(deployment_id)).items()
    }


def test_a_failed_over_attempt_is_pinned_to_a_slot_on_its_new_replica_and_no_other_job_gets_it(
    model: Model, settings: Any
) -> None:
    settings.STREAM_IDLE_TIMEOUT_SECONDS = 20  # a broken failover fails the test, not hangs it
    settings.FAILOVER_WAIT_SECONDS = 20
    get_redis().set(kvcache.ROUTING_KEY, "prefix")
    a, b = small_node(), small_node()
    deps = {str(d.id): d for d in (serving_deployment(model, a), serving_deployment(model, b))}
    seen: dict[str, Any] = {}

    agents = RunJobAgents([str(a.id), str(b.id)])
    with agents:
        adm = admit(model, "first conversation")
        assert adm.dispatched and adm.kv is not None and adm.kv.policy == "prefix"
        job = adm.job_id
        old = adm.deployment_id
        assert old is not None
        (new,) = set(deps) - {old}
        first_slot = adm.kv.slot
        assert first_slot is not None and busy(old) == {str(first_slot): job}
        (sent,) = agents.payloads(job)
        assert sent[1]["id_slot"] == first_slot

        async def drive() -> list[dict[str, str]]:
            got: list[dict[str, str]] = []
            first, entries = await serving.stream_open(adm=adm)
            got.append(first)
            async for fields in entries:
                got.append(fields)
                if fields.get("type") == "chunk" and fields.get("attempt") == "2":
                    # Attempt 2 runs on the new replica: what the KV coordinator holds now.
                    seen["busy_old"], seen["busy_new"] = busy(old), busy(new)
                    second = await serving.pooled(admit)(model, "another conversation")
                    seen["second"] = second
                    seen["busy_new_after"] = busy(new)
                    get_redis().xadd(
                        job_stream_key(job, str(deps[new].primary_id)),
                        entry(1, "done", "", "stop", {"completion_tokens": 1}, attempt=2),
                    )
            return got

        got = async_to_sync(drive)()
        async_to_sync(serving.pooled(serving.admission_finish))(
            adm=adm, outcome="completed", entry=got[-1]
        )
        runs = agents.payloads(job, at_least=2)
        second_runs = agents.payloads(seen["second"].job_id)

    # The failover really happened: old primary dead, attempt 2 on the other replica.
    assert [(e["type"], e["attempt"]) for e in got] == [
        ("chunk", "1"),
        ("chunk", "2"),
        ("done", "2"),
    ]
    assert Deployment.objects.get(pk=old).state == DeploymentState.FAILED
    assert adm.deployment_id == new and adm.follower is not None and adm.follower.attempt == 2
    assert [(n, p.get("attempt", 1)) for n, p in runs] == [
        (str(deps[old].primary_id), 1),
        (str(deps[new].primary_id), 2),
    ]
    attempt2 = runs[1][1]
    assert attempt2["resume_tokens"] == [FIRST_TOKEN]

    # 1. run_job for attempt 2 carries the slot the coordinator pinned on the new replica.
    assert "id_slot" in attempt2, json.dumps(attempt2)
    slot = attempt2["id_slot"]
    assert isinstance(slot, int) and 0 <= slot < deps[new].n_parallel
    assert adm.kv is not None and (adm.kv.slot, adm.kv.slot_deployment_id) == (slot, new)
    # 2. The new replica's busy hash has that slot pinned to the job.
    assert seen["busy_new"] == {str(slot): job}
    # 3. The dead attempt's pin on the old replica is gone.
    assert job not in seen["busy_old"].values(), seen["busy_old"]
    # 4. A second job admitted to the new replica (the old one is failed) gets another slot.
    second: serving.Admission = seen["second"]
    assert second.dispatched and second.deployment_id == new
    assert second.kv is not None and second.kv.slot is not None
    assert second.kv.slot != slot
    (second_run,) = second_runs
    assert second_run[0] == str(deps[new].primary_id) and second_run[1]["id_slot"] == second.kv.slot
    assert seen["busy_new_after"] == {str(slot): job, str(second.kv.slot): second.job_id}

    # The job's end gives its pin back (kv_finish); the second job's stays.
    assert Job.objects.get(pk=job).state == JobState.COMPLETED
    assert busy(new) == {str(second.kv.slot): second.job_id}
