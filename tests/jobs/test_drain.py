"""Drain: a draining node gets no new jobs, its deployments move first, running jobs finish, then DRAINED."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from apps.jobs import failover
from apps.jobs.deployments import deployment_ensure
from apps.jobs.jobs import job_complete
from apps.jobs.models import Deployment, Job
from apps.jobs.selectors import deployment_route
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model
from apps.nodes.heartbeats import heartbeat_target
from apps.nodes.models import Event, Node
from apps.nodes.services import node_drain, node_undrain
from apps.nodes.states import TRANSITIONS, NodeState
from racon import ids
from tests.factories import JobFactory, NodeFactory
from tests.jobs.helpers import nodes_with_replicas, ready_deployment
from tests.support.fake_agents import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)
S = NodeState


def running_job(model: Model, dep: Deployment, node: Any) -> Job:
    job = JobFactory(
        model=model,
        deployment=dep,
        state=JobState.RUNNING,
        queued_at=timezone.now(),
        dispatched_at=timezone.now(),
    )
    job.nodes.set([node])
    return job


def kinds_in_order(**filters: Any) -> list[str]:
    return list(
        Event.objects.filter(**filters).order_by("created_at", "id").values_list("kind", flat=True)
    )


def test_drained_is_a_state_with_its_own_arrows() -> None:
    assert S.DRAINED in TRANSITIONS[S.DRAINING]
    assert {S.READY, S.OFFLINE} <= TRANSITIONS[S.DRAINED]
    assert S.DRAINED not in TRANSITIONS[S.READY]  # only through DRAINING
    # A drained node's heartbeats keep it drained; an OFFLINE one with the request drains again.
    assert (
        heartbeat_target(current=S.DRAINED, wanted=S.READY, busy=False, drain_requested=True)
        is None
    )
    assert (
        heartbeat_target(current=S.OFFLINE, wanted=S.READY, busy=False, drain_requested=True)
        == S.DRAINING
    )


def test_a_draining_node_moves_its_deployment_first_and_is_drained_after_its_last_job(
    model: Model, settings: Any
) -> None:
    settings.DEPLOYMENT_RPC_TIMEOUT = 5
    settings.DEPLOYMENT_LOAD_TIMEOUT = 5
    a, b = nodes_with_replicas(model, 2)
    old = ready_deployment(model, a)
    job = running_job(model, old, a)
    with FakeAgents([str(a.id), str(b.id)]):
        node_drain(node_id=a.id, now=timezone.now())
    moved = Event.objects.get(kind="DEPLOYMENT_MIGRATING", deployment=old)
    replacement = Deployment.objects.get(pk=moved.data["replacement"])
    assert replacement.state == DeploymentState.READY and str(replacement.primary_id) == str(b.id)
    # New work goes to the replacement; the old deployment still serves the job it has.
    assert deployment_route(model_id=ids.model_id(model.id)) == replacement
    assert deployment_ensure(model=model, now=timezone.now()) == replacement
    assert Deployment.objects.get(pk=old.pk).state == DeploymentState.READY
    assert Node.objects.get(pk=a.pk).state == S.DRAINING
    assert not Event.objects.filter(node=a, kind="NODE_DRAINED").exists()

    job_complete(
        job_id=ids.job_id(job.id),
        usage={"completion_tokens": 3},
        finish_reason="stop",
        chunks=1,
        now=timezone.now(),
    )
    assert Deployment.objects.get(pk=old.pk).state == DeploymentState.STOPPED
    assert Node.objects.get(pk=a.pk).state == S.DRAINED
    events: list[tuple[Any, ...]] = list(
        Event.objects.order_by("created_at", "id").values_list("kind", "job_id", "node_id")
    )
    completed = events.index(("JOB_COMPLETED", job.id, None))
    drained = [i for i, e in enumerate(events) if e[0] == "NODE_DRAINED" and e[2] == a.id]
    assert len(drained) == 1 and drained[0] > completed
    stopped = Event.objects.get(deployment=old, kind="DEPLOYMENT_STOPPED")
    assert str(replacement.id) in stopped.message


def test_without_capacity_elsewhere_running_jobs_finish_and_the_deployment_stops_at_the_end(
    model: Model,
) -> None:
    (a,) = nodes_with_replicas(model, 1)
    old = ready_deployment(model, a)
    job = running_job(model, old, a)
    node_drain(node_id=a.id, now=timezone.now())
    replacement = Deployment.objects.get(
        pk=Event.objects.get(kind="DEPLOYMENT_MIGRATING", deployment=old).data["replacement"]
    )
    assert replacement.state == DeploymentState.FAILED  # nowhere to go
    assert (
        deployment_route(model_id=ids.model_id(model.id)) is None
    )  # no new job for the draining node
    # A new request waits on the failed replacement, so it fails with the placement's reason.
    assert deployment_ensure(model=model, now=timezone.now()) == replacement
    assert Deployment.objects.get(pk=old.pk).state == DeploymentState.READY
    assert Node.objects.get(pk=a.pk).state == S.DRAINING

    job_complete(
        job_id=ids.job_id(job.id),
        usage={"completion_tokens": 3},
        finish_reason="stop",
        chunks=1,
        now=timezone.now(),
    )
    assert Deployment.objects.get(pk=old.pk).state == DeploymentState.STOPPED
    assert "no capacity" in Event.objects.get(deployment=old, kind="DEPLOYMENT_STOPPED").message
    assert Node.objects.get(pk=a.pk).state == S.DRAINED
    assert kinds_in_order(node=a).count("NODE_DRAINED") == 1


def test_undrain_returns_a_drained_node_to_ready_and_routing_to_its_deployments(
    model: Model,
) -> None:
    a = NodeFactory(state=S.READY)
    ready_deployment(model, a)
    node = node_drain(node_id=ids.node_id(a.id), now=timezone.now())
    assert node.state == S.DRAINED and node.drain_requested
    node = node_undrain(node_id=ids.node_id(a.id), now=timezone.now())
    assert node.state == S.READY and not node.drain_requested
    assert kinds_in_order(node=a)[-2:] == ["NODE_DRAINED", "NODE_UNDRAINED"]


def test_the_cached_route_forgets_a_deployment_once_its_node_drains(
    model: Model, settings: Any
) -> None:
    settings.API_CACHE_SECONDS = 30
    a, b = NodeFactory(state=S.READY), NodeFactory(state=S.READY)
    on_a, on_b = ready_deployment(model, a), ready_deployment(model, b)
    running_job(
        model, on_a, a
    )  # keeps the drain open (its replacement is refused: b serves the model)
    assert {deployment_route(model_id=ids.model_id(model.id), cached=True) for _ in range(20)} == {
        on_a,
        on_b,
    }
    node_drain(node_id=ids.node_id(a.id), now=timezone.now())
    assert {deployment_route(model_id=ids.model_id(model.id), cached=True) for _ in range(20)} == {
        on_b
    }


def test_failover_waiters_polling_a_model_without_capacity_start_one_placement_not_a_flood(
    model: Model,
) -> None:
    # No node can hold the model: every automatic placement fails at once. Waiters poll each second.
    now = timezone.now()
    routes = [
        failover.job_failover_route(model_id=ids.model_id(model.id), exclude=[], now=now)
        for _ in range(5)
    ]
    auto = Deployment.objects.filter(model=model)
    assert auto.count() == 1, [(d.state, d.created_at) for d in auto]
    assert auto.get().state == DeploymentState.FAILED and routes[1:] == [None] * 4
