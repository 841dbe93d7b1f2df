"""A pause's failover handoff (agent/lifecycle.py hand_off_jobs): each running job's attempt ends
with one node_paused error, after everything it streamed, in one gap-free seq."""

from __future__ import annotations

import time
from typing import Any

from agent import lifecycle
from agent.redis_link import RedisLink
from agent.registry import DeploymentRegistry
from agent.runtime.fake import FakePrimary
from tests.agent.harness import read_stream

NODE = "node-handoff-test"


def _loaded(r: Any, registry: DeploymentRegistry, dep_id: str, finished: list[Any]) -> FakePrimary:
    plan: Any = {"deployment_id": dep_id, "rpc_endpoints": []}
    registry.register(plan)
    primary = FakePrimary(
        plan=plan,
        node_id=NODE,
        redis_client=r,
        on_event=lambda *a, **k: None,
        on_job_finished=finished.append,
        on_exit=lambda dep: None,
        tokens=tuple(f"t{i} " for i in range(2000)),
        token_delay=0.0005,
        fail_load=None,
    )
    primary.load()
    registry.mark_loaded(dep_id, primary, {})
    return primary


def test_a_handed_off_job_ends_once_after_its_chunks_in_one_seq(
    redis_client: Any, job_id: str
) -> None:
    registry = DeploymentRegistry()
    finished: list[Any] = []
    dep_id = "dep-handoff"
    primary = _loaded(redis_client, registry, dep_id, finished)
    link = RedisLink()
    link.client = redis_client
    try:
        job: Any = {"job_id": job_id, "deployment_id": dep_id}
        registry.add_job(job)
        primary.submit(job)
        deadline = time.monotonic() + 30
        while len(read_stream(redis_client, job_id)) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)  # the job streams: the handoff lands mid-stream
        assert lifecycle.hand_off_jobs(registry, link, NODE) == [job_id]
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        entries = read_stream(redis_client, job_id)
    finally:
        primary.stop()
    assert finished and finished[0]["status"] == "failed", finished
    assert [int(e["seq"]) for e in entries] == list(range(len(entries)))
    assert [e["type"] for e in entries].count("error") == 1
    end = entries[-1]
    assert (end["type"], end["code"]) == ("error", "node_paused"), end
    assert 20 <= len(entries) - 1 < 2000  # stopped mid-stream, every chunk before the end


def test_a_job_waiting_for_its_load_is_ended_in_its_stream(redis_client: Any, job_id: str) -> None:
    registry = DeploymentRegistry()
    registry.register({"deployment_id": "dep-loading", "rpc_endpoints": []})  # type: ignore[typeddict-item]
    registry.add_job({"job_id": job_id, "deployment_id": "dep-loading", "attempt": 2})  # type: ignore[typeddict-item]
    link = RedisLink()
    link.client = redis_client
    assert lifecycle.hand_off_jobs(registry, link, NODE) == [job_id]
    entries = read_stream(redis_client, job_id)
    assert [(e["seq"], e["type"], e["code"], e["attempt"]) for e in entries] == [
        ("0", "error", "node_paused", "2")
    ]


def test_handing_off_a_job_the_primary_does_not_run_hands_nothing(
    redis_client: Any, job_id: str
) -> None:
    registry = DeploymentRegistry()
    finished: list[Any] = []
    primary = _loaded(redis_client, registry, "dep-ended", finished)
    try:
        assert primary.hand_off(job_id, "paused", code="node_paused") is False
    finally:
        primary.stop()
    assert read_stream(redis_client, job_id) == []
