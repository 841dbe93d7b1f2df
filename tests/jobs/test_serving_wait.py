"""A request made while the local agent is still starting waits for it (apps/jobs/serving.py,
"a node on its way"), within DEPLOYMENT_WAIT_SECONDS, instead of failing at once with 503 "no
eligible nodes"; with nothing coming it still fails at once.

Real database and Redis, and the real placement (Celery runs eagerly in tests): it refuses while
no node is READY, and loads through FakeAgents (tests/support/fake_agents.py: answers the node's
commands as its agent does) once one is.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connections
from django.utils import timezone

from agent.protocol import HEARTBEATS_ZSET
from apps.jobs import admission, serving
from apps.jobs.models import Deployment, Job
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model
from apps.nodes.models import Node
from apps.nodes.services import node_transition
from apps.nodes.states import NodeState
from racon import ids
from racon.redis import get_redis
from tests.factories import DeploymentFactory, NodeFactory, ReplicaFactory
from tests.jobs.helpers import placeable_model
from tests.support.fake_agents import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # waits run on the thread pool


@pytest.fixture
def model(tmp_path: Path) -> Model:
    return placeable_model(
        name="wait-model", sha256="e" * 64, store=tmp_path / "store-m.gguf", store_bytes=3 * 2**20
    )


def open_(model: Model) -> serving.Admission:
    return serving.admission_open(
        model_name=model.name,
        account_id=None,
        api_key_id=None,
        kind="chat",
        params={"messages": [{"role": "user", "content": "hi"}]},
        max_tokens=8,
        stream=False,
        request_id="req-wait",
        hold=None,
        now=timezone.now(),
    )


def _serve_on(dep_id: Any, node: Node) -> None:
    """What a placement does once the node is READY and its agent loaded the model."""
    Deployment.objects.filter(pk=dep_id).update(
        state=DeploymentState.READY,
        primary=node,
        plan={
            "primary_node_id": str(node.id),
            "devices": [
                {"node_id": str(node.id), "device": "CPU", "layer_start": 0, "layer_end": 30}
            ],
        },
        ready_at=timezone.now(),
    )
    Deployment.objects.get(pk=dep_id).nodes.set([node])


def test_a_request_sent_while_the_deployment_is_loading_is_served_once_it_turns_ready(
    model: Model,
) -> None:
    node = NodeFactory()
    dep = DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        state=DeploymentState.LOADING,
        primary=None,
        n_parallel=1,
    )
    adm = open_(model)
    assert not adm.dispatched and adm.deployment_id == str(dep.id)
    timer = threading.Timer(1.0, lambda: (_serve_on(dep.id, node), connections.close_all()))
    timer.start()
    try:
        async_to_sync(serving.admission_wait)(adm=adm, standing=lambda: 0.0)
    finally:
        timer.join()
    assert adm.dispatched and adm.primary_id == str(node.id)
    assert Job.objects.get(pk=adm.job_id).state == JobState.DISPATCHED


def test_a_request_while_the_only_node_is_still_registering_waits_and_is_served_once_it_is_ready(
    model: Model, settings: Any
) -> None:
    settings.DEPLOYMENT_WAIT_SECONDS = 60
    node = NodeFactory(state=NodeState.REGISTERING, state_changed_at=timezone.now())
    ReplicaFactory(node=node, model_file=model.files.get(), path="/models/m.gguf")
    before: dict[str, Any] = {}
    with FakeAgents([str(node.id)]):
        adm = open_(model)  # no deployment yet: one is created, and its placement is refused
        first = adm.deployment_id
        assert first is not None

        def turn_ready() -> None:
            try:
                # What the request saw until now: every placement refused, the job still queued.
                got = Deployment.objects.get(pk=first)
                before.update(state=got.state, error=got.error)
                before["job"] = Job.objects.get(pk=adm.job_id).state
                node_transition(
                    node_id=ids.node_id(node.id),
                    to=NodeState.READY,
                    expected=NodeState.REGISTERING,
                    now=timezone.now(),
                )
            finally:
                connections.close_all()

        timer = threading.Timer(2.5, turn_ready)
        timer.start()
        began = time.monotonic()
        try:
            async_to_sync(serving.admission_wait)(adm=adm, standing=lambda: 0.0)
        finally:
            timer.join()
        waited = time.monotonic() - began
    assert before["state"] == DeploymentState.FAILED and "no eligible nodes" in before["error"]
    assert before["job"] == JobState.QUEUED
    assert waited >= 2.0  # it waited for the node rather than failing
    assert adm.dispatched and adm.primary_id == str(node.id) and adm.deployment_id != first
    job = Job.objects.get(pk=adm.job_id)
    assert job.state == JobState.DISPATCHED and str(job.deployment_id) == adm.deployment_id
    served = Deployment.objects.get(pk=adm.deployment_id)
    node.refresh_from_db()
    assert served.state == DeploymentState.READY and served.created_at > node.state_changed_at


def test_with_nothing_coming_the_request_still_fails_at_once(model: Model, settings: Any) -> None:
    settings.DEPLOYMENT_WAIT_SECONDS = 120
    long_ago = timezone.now() - timedelta(hours=1)
    # Rows that read as starting but whose agents are long gone, and a READY node too small for
    # the model (the placement refuses it): none of them is on its way.
    NodeFactory(state=NodeState.OFFLINE, state_changed_at=long_ago)
    NodeFactory(state=NodeState.REGISTERING, state_changed_at=long_ago)
    small = NodeFactory(
        state=NodeState.READY, state_changed_at=long_ago, ram_total=1, ram_available=1
    )
    small.hardware["memory"] = {"total": 1, "available": 1}
    small.save()
    adm = open_(model)
    began = time.monotonic()
    with pytest.raises(admission.DeploymentUnavailable) as exc:
        async_to_sync(serving.admission_wait)(adm=adm, standing=lambda: 0.0)
    elapsed = time.monotonic() - began
    # Well under the DEPLOYMENT_WAIT_SECONDS it would have waited for a coming node (measured: a
    # few seconds, one deployment status poll per second).
    assert elapsed < settings.DEPLOYMENT_WAIT_SECONDS / 2, elapsed
    assert exc.value.reason
    job = Job.objects.get(pk=adm.job_id)
    assert job.state == JobState.FAILED and job.failed_during_execution is False


def test_a_node_is_on_its_way_while_it_handshakes_or_heartbeats_from_offline(
    settings: Any,
) -> None:
    settings.HEARTBEAT_INTERVAL = 1.0
    settings.HEARTBEAT_OFFLINE_AFTER = 10
    now = timezone.now()
    assert not serving.nodes_coming(now=now)
    stale = NodeFactory(state=NodeState.REGISTERING, state_changed_at=now - timedelta(minutes=5))
    offline = NodeFactory(state=NodeState.OFFLINE, state_changed_at=now - timedelta(minutes=5))
    assert not serving.nodes_coming(now=now)
    # The restarted agent of the OFFLINE node heartbeats (it is handshaking): on its way.
    get_redis().zadd(HEARTBEATS_ZSET, {str(offline.id): now.timestamp() - 2})
    assert serving.nodes_coming(now=now)
    get_redis().zadd(HEARTBEATS_ZSET, {str(offline.id): now.timestamp() - 60})
    assert not serving.nodes_coming(now=now)
    # Just enrolled, no heartbeat yet: on its way; unless its owner is draining it or revoked it.
    fresh = NodeFactory(state=NodeState.REGISTERING, state_changed_at=now - timedelta(seconds=3))
    assert serving.nodes_coming(now=now)
    Node.objects.filter(pk=fresh.pk).update(drain_requested=True)
    assert not serving.nodes_coming(now=now)
    Node.objects.filter(pk=fresh.pk).update(drain_requested=False, revoked_at=now)
    assert not serving.nodes_coming(now=now)
    assert stale.state == NodeState.REGISTERING
