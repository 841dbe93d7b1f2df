"""A restarted agent says which deployments it holds; the controller fails the ones it lost."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from apps.jobs.models import Deployment, Job
from apps.jobs.reports import report_accept
from apps.jobs.states import DeploymentState, JobState
from apps.nodes.models import Event
from racon import ids
from tests.factories import ModelFactory, NodeFactory, deployment_for, job_for

pytestmark = pytest.mark.django_db


def started(node: Any, deployments: list[str], report_id: str = "start-1") -> Any:
    return report_accept(
        node_id=node.id,
        report={
            "id": report_id,
            "kind": "event",
            "payload": {
                "event": "AGENT_STARTED",
                "message": "agent started",
                "data": {"deployments": deployments, "loading": []},
            },
        },
        now=timezone.now(),
    )


def state(dep: Deployment) -> str:
    return Deployment.objects.get(pk=dep.pk).state


def test_a_restarted_agent_fails_and_replaces_the_deployments_it_no_longer_holds() -> None:
    a, b = NodeFactory(), NodeFactory()
    model = ModelFactory()
    primary_on_a = deployment_for([(a, 30)], model=model)
    worker_on_a = deployment_for([(b, 20), (a, 10)], model=model, primary=b)  # a's RPC worker
    only_b = deployment_for([(b, 30)], model=model)
    still_held = deployment_for([(a, 30)], model=model)
    queued = job_for(account=None, model=model, deployment=primary_on_a)

    got = started(a, [str(still_held.pk)])

    assert set(got["deployments_failed"]) == {str(primary_on_a.pk), str(worker_on_a.pk)}
    assert state(primary_on_a) == state(worker_on_a) == DeploymentState.FAILED
    assert state(only_b) == state(still_held) == DeploymentState.READY
    # Replaced at once (the placement runs on commit), the queued job nobody reads is ended.
    assert Event.objects.filter(kind="DEPLOYMENT_REPLACED").count() == 2
    assert Event.objects.filter(kind="AGENT_STARTED", node_id=a.id).count() == 1
    assert Job.objects.get(pk=queued.pk).state == JobState.FAILED
    # A repeated start (the report retried under a new id) changes nothing more.
    assert started(a, [str(still_held.pk)], "start-2") == {"deployments_failed": []}
    assert Event.objects.filter(kind="DEPLOYMENT_REPLACED").count() == 2


def test_a_fresh_agent_start_leaves_loading_and_other_nodes_deployments_alone() -> None:
    a, b = NodeFactory(), NodeFactory()
    model = ModelFactory()
    loading = deployment_for([(a, 30)], model=model)
    Deployment.objects.filter(pk=loading.pk).update(state=DeploymentState.LOADING)
    elsewhere = deployment_for([(b, 30)], model=model)
    assert started(a, []) == {"deployments_failed": []}
    assert state(loading) == DeploymentState.LOADING  # the placement owns a load in progress
    assert state(elsewhere) == DeploymentState.READY


def test_a_malformed_start_report_is_refused() -> None:
    node = NodeFactory()
    with pytest.raises(ValueError, match="deployments"):
        report_accept(
            node_id=ids.node_id(node.id),
            report={
                "id": "bad",
                "kind": "event",
                "payload": {"event": "AGENT_STARTED", "data": {"deployments": "all"}},
            },
            now=timezone.now(),
        )
    assert not Event.objects.filter(kind="AGENT_STARTED").exists()
