"""Deployments and jobs on the real database and Redis; the agents' side is played at the Redis edge."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from agent.protocol import job_stream_key
from apps.jobs import placement
from apps.jobs.deployments import (
    deployment_preview,
    deployments_on_node_state,
    placement_request_from,
)
from apps.jobs.jobs import job_complete, job_fail
from apps.jobs.models import Deployment, Job
from apps.jobs.reports import report_accept
from apps.jobs.stale import jobs_fail_stale
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model
from apps.nodes.models import Event
from apps.nodes.states import NodeState
from racon import ids
from racon.ids import JobId
from racon.redis import get_redis
from tests.factories import JobAttemptFactory, JobFactory, NodeFactory
from tests.jobs.helpers import nodes_with_replicas, planning_deployment, ready_deployment
from tests.support.fake_agents import FakeAgents

pytestmark = pytest.mark.django_db
GiB = 1024**3


@pytest.mark.django_db(transaction=True)
def test_node_lost_before_execution_triggers_a_revised_plan(model: Model, settings: Any) -> None:
    settings.DEPLOYMENT_RPC_TIMEOUT = 5
    settings.DEPLOYMENT_LOAD_TIMEOUT = 5
    a, b = nodes_with_replicas(model, 2)
    dep = planning_deployment(model)
    first_choice = deployment_preview(
        model_file=model.files.get(), request=placement_request_from({"n_ctx": 512})
    ).primary_node_id
    with FakeAgents([str(a.id), str(b.id)], fail_load_on={first_choice}):
        result = placement.deployment_place(deployment_id=ids.deployment_id(dep.id))
    assert result.state == DeploymentState.READY, result.error
    assert str(result.primary_id) != first_choice
    kinds = list(
        Event.objects.filter(deployment=dep)
        .order_by("created_at", "id")
        .values_list("kind", flat=True)
    )
    assert (
        kinds.index("PLAN_CHOSEN")
        < kinds.index("NODE_LOST_BEFORE_EXECUTION")
        < kinds.index("PLAN_REVISED")
        < kinds.index("DEPLOYMENT_READY")
    )


def test_impossible_placement_fails_with_the_refusal(model: Model) -> None:
    NodeFactory(state=NodeState.READY, ram_available=10 * 1024**2)
    dep = planning_deployment(model)
    result = placement.deployment_place(deployment_id=ids.deployment_id(dep.id))
    assert result.state == DeploymentState.FAILED
    assert "more memory" in result.error or "memory" in result.error
    assert Event.objects.filter(deployment=dep, kind="PLACEMENT_REFUSED").exists()


def test_member_lost_after_ready_fails_the_deployment_its_jobs_and_replaces_it(
    model: Model,
) -> None:
    node = NodeFactory(state=NodeState.READY)
    dep = ready_deployment(model, node)
    job = JobFactory(model=model, deployment=dep, state=JobState.RUNNING, queued_at=timezone.now())
    deployments_on_node_state(
        node_id=ids.node_id(node.id), state=NodeState.OFFLINE, now=timezone.now()
    )
    dep.refresh_from_db()
    job.refresh_from_db()
    assert dep.state == DeploymentState.FAILED
    assert job.state == JobState.FAILED and job.failed_during_execution is True
    assert Deployment.objects.filter(model=model, state=DeploymentState.PLANNING).count() == 1
    assert Event.objects.filter(deployment=dep, kind="DEPLOYMENT_REPLACED").exists()


def test_member_degraded_then_recovered_moves_the_deployment_with_it(model: Model) -> None:
    node = NodeFactory(state=NodeState.READY)
    dep = ready_deployment(model, node)
    deployments_on_node_state(
        node_id=ids.node_id(node.id), state=NodeState.DEGRADED, now=timezone.now()
    )
    assert Deployment.objects.get(pk=dep.pk).state == DeploymentState.DEGRADED
    deployments_on_node_state(
        node_id=ids.node_id(node.id), state=NodeState.READY, now=timezone.now()
    )
    assert Deployment.objects.get(pk=dep.pk).state == DeploymentState.READY


def test_routing_prefers_ready_deployments_with_less_work_in_flight(model: Model) -> None:
    from apps.jobs import admission
    from apps.jobs.selectors import deployment_route

    d1 = ready_deployment(model, NodeFactory())
    d2 = ready_deployment(model, NodeFactory())
    Deployment.objects.filter(pk__in=[d1.pk, d2.pk]).update(n_parallel=4)
    for k in range(3):
        assert admission.slot_try(
            deployment_id=ids.deployment_id(d1.id), job_id=JobId(f"busy-{k}"), cap=4
        )
    assert all(deployment_route(model_id=ids.model_id(model.id)) == d2 for _ in range(5))
    Deployment.objects.filter(pk=d2.pk).update(state=DeploymentState.DEGRADED)
    assert deployment_route(model_id=ids.model_id(model.id)) == d1


def test_a_stream_that_ended_finishes_its_job_and_a_silent_one_fails(
    model: Model, settings: Any
) -> None:
    settings.STREAM_IDLE_TIMEOUT_SECONDS = 1
    node = NodeFactory()
    dep = ready_deployment(model, node)
    now = timezone.now()
    ended = JobFactory(
        model=model, deployment=dep, state=JobState.RUNNING, queued_at=now, dispatched_at=now
    )
    silent = JobFactory(
        model=model,
        deployment=dep,
        state=JobState.DISPATCHED,
        queued_at=now - timedelta(minutes=5),
        dispatched_at=now - timedelta(minutes=5),
    )
    key = job_stream_key(str(ended.id), str(node.id))
    get_redis().xadd(
        key,
        {"seq": "0", "attempt": "1", "type": "chunk", "text": "a b c", "ids": "[1,2,3]", "n": "3"},
    )
    get_redis().xadd(
        key,
        {
            "seq": "1",
            "attempt": "1",
            "type": "chunk",
            "text": " d e f g",
            "ids": "[4,5,6,7]",
            "n": "4",
        },
    )
    # The node's own usage claims more than it streamed: the controller's count is what is billed.
    get_redis().xadd(
        key,
        {
            "seq": "2",
            "attempt": "1",
            "type": "done",
            "text": "",
            "finish_reason": "stop",
            "usage": json.dumps({"prompt_tokens": 3, "completion_tokens": 70}),
        },
    )
    counts = jobs_fail_stale(now=now + timedelta(seconds=30))
    assert counts["finished_from_stream"] == 1 and counts["silent"] == 1
    ended.refresh_from_db()
    silent.refresh_from_db()
    assert (
        ended.state == JobState.COMPLETED
        and ended.completion_tokens == 7
        and ended.stream_chunks == 2
    )
    assert silent.state == JobState.FAILED


def test_an_earlier_attempts_error_on_the_same_node_does_not_end_the_retried_job(
    model: Model, settings: Any
) -> None:
    """Failover to another replica on the same node writes attempt 2 into the same stream key:
    attempt 1's error entry is not the job's end while attempt 2 runs (a vLLM e2e run once ended
    a job FAILED whose stream had completed cleanly)."""
    settings.STREAM_IDLE_TIMEOUT_SECONDS = 60
    node = NodeFactory()
    dep = ready_deployment(model, node)
    now = timezone.now()
    job = JobFactory(
        model=model, deployment=dep, state=JobState.RUNNING, queued_at=now, dispatched_at=now
    )
    JobAttemptFactory(job=job, number=1, deployment=dep, primary=node, started_at=now)
    JobAttemptFactory(job=job, number=2, deployment=dep, primary=node, started_at=now)
    key = job_stream_key(str(job.id), str(node.id))
    get_redis().xadd(key, {"seq": "0", "attempt": "1", "type": "error", "text": "engine died"})
    counts = jobs_fail_stale(now=now + timedelta(seconds=30))
    job.refresh_from_db()
    assert counts["finished_from_stream"] == 0 and job.state == JobState.RUNNING
    get_redis().xadd(
        key,
        {"seq": "0", "attempt": "2", "type": "done", "text": "", "finish_reason": "stop"},
    )
    assert jobs_fail_stale(now=now + timedelta(seconds=30))["finished_from_stream"] == 1
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED


def test_a_duplicate_report_is_applied_once() -> None:
    node = NodeFactory()
    report = {
        "id": "same-id",
        "kind": "event",
        "payload": {"event": "RPC_WORKER_STARTED", "message": "up", "data": {}},
    }
    report_accept(node_id=ids.node_id(node.id), report=report, now=timezone.now())
    assert report_accept(node_id=ids.node_id(node.id), report=report, now=timezone.now()) == {
        "duplicate": True
    }
    assert Event.objects.filter(kind="RPC_WORKER_STARTED").count() == 1


def test_malformed_reports_are_refused_and_leave_nothing() -> None:
    node = NodeFactory()
    for payload in (
        {"kind": "models", "payload": {"models": "x"}},
        {"kind": "job_finished", "payload": {}},
        {"kind": "event", "payload": {}},
    ):
        with pytest.raises(ValueError):
            report_accept(
                node_id=ids.node_id(node.id),
                report={"id": f"r{time.time_ns()}", **payload},
                now=timezone.now(),
            )
    assert not Event.objects.exists()


def test_job_terminal_states_are_final(model: Model) -> None:
    job = JobFactory(model=model, state=JobState.QUEUED, queued_at=timezone.now())
    assert job_fail(job_id=ids.job_id(job.id), now=timezone.now(), error="x")
    assert not job_complete(
        job_id=ids.job_id(job.id), usage={}, finish_reason="stop", chunks=0, now=timezone.now()
    )
    assert Job.objects.get(pk=job.id).state == JobState.FAILED


_ = Path


def test_a_running_job_shows_its_tokens_and_rate_from_the_stream(model: Model, client: Any) -> None:
    node = NodeFactory()
    dep = ready_deployment(model, node)
    started = timezone.now() - timedelta(seconds=10)
    job = JobFactory(
        model=model,
        deployment=dep,
        state=JobState.RUNNING,
        queued_at=started,
        dispatched_at=started,
        first_token_at=started,
    )
    for i in range(10):
        get_redis().xadd(
            job_stream_key(str(job.id), str(node.id)),
            {"seq": str(i), "type": "chunk", "text": "x", "finish_reason": "", "usage": ""},
        )
    row = client.get(
        "/api/admin/jobs?state=RUNNING", headers={"Authorization": "Bearer test-operator-key"}
    ).json()[0]
    assert row["completion_tokens"] == 10
    assert 0 < row["tokens_per_s"] <= 1.0  # 10 tokens over at least 10 s
    detail = client.get(
        f"/api/admin/jobs/{job.id}", headers={"Authorization": "Bearer test-operator-key"}
    ).json()
    assert detail["completion_tokens"] == 10


@pytest.mark.django_db(transaction=True)
def test_a_replica_claim_that_fails_its_hash_challenge_is_dropped_and_the_stores_copy_sent(
    model: Model, settings: Any
) -> None:
    from apps.models_repo.models import Replica

    settings.DEPLOYMENT_RPC_TIMEOUT = 5
    (liar,) = nodes_with_replicas(model, 1)
    dep = planning_deployment(model)
    with FakeAgents([str(liar.id)], liars={str(liar.id)}) as agents:
        placement.deployment_place(deployment_id=ids.deployment_id(dep.id))
    kinds = [k for _, k in agents.seen]
    # Its claim was challenged and failed, so the file was copied from the store, and the copy
    # was challenged in turn (which this liar fails too): it never loads a file it cannot show.
    assert kinds[:3] == ["hash_challenge", "fetch_model", "hash_challenge"]
    assert "load_primary" not in kinds
    events = list(Event.objects.filter(node_id=liar.id, kind="REPLICA_CHALLENGE_FAILED"))
    assert len(events) >= 2 and "do not match" in events[0].message
    assert not Replica.objects.filter(node=liar, model_file=model.files.get()).exists()


@pytest.mark.django_db(transaction=True)
def test_an_honest_replica_answers_its_challenge_and_is_used_without_a_copy(
    model: Model, settings: Any
) -> None:
    settings.DEPLOYMENT_RPC_TIMEOUT = 5
    settings.DEPLOYMENT_LOAD_TIMEOUT = 5
    (node,) = nodes_with_replicas(model, 1)
    dep = planning_deployment(model)
    with FakeAgents([str(node.id)]) as agents:
        placed = placement.deployment_place(deployment_id=ids.deployment_id(dep.id))
    assert placed.state == DeploymentState.READY, placed.error
    kinds = [k for _, k in agents.seen]
    assert "hash_challenge" in kinds and "fetch_model" not in kinds
    assert Event.objects.filter(node_id=node.id, kind="REPLICA_VERIFIED").exists()
