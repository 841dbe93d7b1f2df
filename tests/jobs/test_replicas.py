"""Replicas: slots from memory on a real placement, one replica per node, and the autoscaler.

Real database and Redis; the agents' side is played at the Redis edge (FakeAgents).
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.jobs import admission, placement
from apps.jobs.autoscale import autoscale_key, replicas_autoscale
from apps.jobs.deployments import deployment_ensure, deployment_stop, placement_request_from
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from apps.nodes.models import Event
from racon import ids
from racon.ids import DeploymentId, JobId
from racon.redis import get_redis
from tests.factories import DeploymentFactory, NodeFactory
from tests.jobs.helpers import nodes_with_replicas, ready_deployment
from tests.support.fake_agents import FakeAgents

pytestmark = pytest.mark.django_db
GiB = 1024**3
OPERATOR = {"Authorization": "Bearer test-operator-key"}
D = DeploymentState


class RecordingAgents(FakeAgents):
    """FakeAgents that also keep each load_primary payload (what the agent is told to start)."""

    def __init__(self, node_ids: list[str]) -> None:
        super().__init__(node_ids)
        self.loads: list[dict[str, Any]] = []

    def answer(self, node_id: str, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["kind"] == "load_primary":
            self.loads.append(cmd["payload"])
        return super().answer(node_id, cmd)


# --- slots on a real placement -----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_placed_deployment_records_the_slots_memory_allows_and_the_agent_gets_them(
    model: Model, settings: Any
) -> None:
    settings.DEFAULT_N_PARALLEL_MAX = 16
    (a,) = nodes_with_replicas(model, 1)
    dep = DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        state=DeploymentState.PLANNING,
        primary=None,
        request=placement_request_from({"n_ctx": 512}).to_dict(),
    )
    with RecordingAgents([str(a.id)]) as agents:
        result = placement.deployment_place(deployment_id=ids.deployment_id(dep.id))
    assert result.state == D.READY, result.error
    assert (
        result.n_parallel == result.plan["n_parallel"] == 16
    )  # SmolLM2 at 512 tokens: memory is plenty
    assert result.n_ctx == result.plan["n_ctx"] == 512
    (load,) = agents.loads
    assert (load["n_parallel"], load["n_ctx"]) == (16, 512)


def test_placement_request_keeps_a_bad_slot_count_for_the_scheduler_to_refuse() -> None:
    assert placement_request_from({}).n_parallel is None
    assert placement_request_from({"n_parallel": 0}).n_parallel == 0
    assert placement_request_from({"n_parallel": 3}).n_parallel == 3


def test_deploy_api_refuses_zero_slots_with_400_naming_the_limit(
    client: Client, model: Model
) -> None:
    nodes_with_replicas(model, 1)
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol", "n_parallel": 0},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["fields"]["n_parallel"] == ["n_parallel must be at least 1"]


def test_deploy_api_refuses_more_slots_than_memory_allows_with_400_naming_the_limit(
    client: Client, model: Model
) -> None:
    NodeFactory(name="small", ram_available=int(0.6 * GiB))
    body = {"model": "smol", "n_parallel": 64, "n_ctx": 8192}
    for url in ("/api/admin/deployments/preview", "/api/admin/deployments"):
        resp = client.post(url, body, content_type="application/json", headers=OPERATOR)
        assert resp.status_code == 400, resp.content
        err = resp.json()["error"]
        assert err["code"] == "n_parallel_too_large" and err["param"] == "n_parallel"
        assert err["message"].startswith("n_parallel 64 needs ")
        assert (
            "of KV on small CPU" in err["message"]
            and f"at most {err['limit']} slots fit" in err["message"]
        )
        assert 1 <= err["limit"] < 64
    assert not Deployment.objects.exists()


# --- one replica per node ----------------------------------------------------------------------


def test_a_second_deployment_on_the_only_node_is_refused_unless_the_operator_allows_it(
    client: Client, model: Model
) -> None:
    (a,) = nodes_with_replicas(model, 1)
    ready_deployment(model, a)
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol"},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 422
    assert "already serve this model" in resp.json()["error"]["message"]
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol", "allow_same_node": True},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 202, resp.content
    assert resp.json()["request"]["allow_same_node"] is True


@pytest.mark.django_db(transaction=True)
def test_concurrent_first_requests_create_one_deployment_between_them(
    model: Model, settings: Any
) -> None:
    nodes = nodes_with_replicas(model, 2)
    barrier = threading.Barrier(4)
    got: list[Any] = []

    def first_request() -> None:
        from django.db import connection

        try:
            barrier.wait()
            got.append(deployment_ensure(model=model, now=timezone.now()).id)
        finally:
            connection.close()

    with FakeAgents([str(n.id) for n in nodes]):
        threads = [threading.Thread(target=first_request) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert len(got) == 4 and len(set(got)) == 1
    assert Deployment.objects.filter(model=model).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_placements_at_once_put_their_replicas_on_different_nodes(model: Model) -> None:
    nodes = nodes_with_replicas(model, 2)
    deps = [
        DeploymentFactory(
            model=model,
            model_file=model.files.get(),
            state=DeploymentState.PLANNING,
            primary=None,
            request=placement_request_from({"n_ctx": 512}).to_dict(),
        )
        for _ in range(2)
    ]
    barrier = threading.Barrier(2)

    def place(dep_id: Any) -> None:
        from django.db import connection

        try:
            barrier.wait()
            placement.deployment_place(deployment_id=dep_id)
        finally:
            connection.close()

    with FakeAgents([str(n.id) for n in nodes]):
        threads = [threading.Thread(target=place, args=(d.id,)) for d in deps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    placed = [Deployment.objects.get(pk=d.id) for d in deps]
    assert [p.state for p in placed] == [D.READY, D.READY], [p.error for p in placed]
    assert placed[0].primary_id != placed[1].primary_id


# --- replicas follow load ----------------------------------------------------------------------


def queue_pressure(model: Model, dep: Deployment, at: datetime, *, waited: float) -> None:
    """What admission records while requests queue: a live waiter and its time in the queue."""
    t = at.timestamp()
    admission.queue_join(
        deployment_id=ids.deployment_id(dep.id),
        job_id=JobId("job-waiting"),
        priority=t,
        model_id=ids.model_id(model.id),
        now=t,
    )
    admission.queue_wait_record(model_id=ids.model_id(model.id), seconds=waited, now=t)


@pytest.fixture
def thresholds(settings: Any) -> Any:
    settings.REPLICA_AUTOSCALE_SECONDS = 1.0
    settings.REPLICA_SCALE_UP_WAIT_SECONDS = 1.0
    settings.REPLICA_SCALE_UP_SUSTAIN_SECONDS = 5.0
    settings.REPLICA_IDLE_SECONDS = 30.0
    settings.REPLICA_MAX_PER_MODEL = 3
    settings.DEPLOYMENT_RPC_TIMEOUT = 5
    settings.DEPLOYMENT_LOAD_TIMEOUT = 5
    return settings


@pytest.mark.django_db(transaction=True)
def test_a_replica_is_added_under_sustained_queueing_and_removed_after_idling(
    model: Model, thresholds: Any
) -> None:
    a, b = nodes_with_replicas(model, 2)
    first = ready_deployment(model, a)
    t0 = timezone.now()
    with FakeAgents([str(a.id), str(b.id)]):
        # Queueing that has not lasted long enough adds nothing.
        queue_pressure(model, first, t0, waited=4.0)
        assert replicas_autoscale(now=t0).added == []
        queue_pressure(model, first, t0 + timedelta(seconds=3), waited=4.0)
        assert replicas_autoscale(now=t0 + timedelta(seconds=3)).added == []
        # Sustained: one more replica, on the node that does not serve the model yet.
        t1 = t0 + timedelta(seconds=6)
        queue_pressure(model, first, t1, waited=4.0)
        report = replicas_autoscale(now=t1)
        assert len(report.added) == 1
        added = Deployment.objects.get(pk=report.added[0])
        assert added.state == D.READY, added.error  # placed by the (eager) Celery task
        assert added.primary_id == b.id
        event = Event.objects.get(kind="REPLICA_ADDED")
        assert event.deployment_id == added.id and event.data["replicas"] == 2
        assert event.data["queue_wait_seconds"] > 1.0

        # The queue drains; the added replica idles, the cool-down runs, then it is stopped.
        admission.queue_leave(
            deployment_id=ids.deployment_id(first.id), job_id=JobId("job-waiting")
        )
        t2 = t1 + timedelta(seconds=120)
        assert replicas_autoscale(now=t2).removed == []  # first seen idle
        assert replicas_autoscale(now=t2 + timedelta(seconds=20)).removed == []
        report = replicas_autoscale(now=t2 + timedelta(seconds=31))
        assert report.removed == [str(added.id)]
    assert Deployment.objects.get(pk=added.id).state == D.STOPPED
    assert Deployment.objects.get(pk=first.id).state == D.READY
    removed = Event.objects.get(kind="REPLICA_REMOVED")
    assert removed.deployment_id == added.id and removed.data["idle_seconds"] >= 30


@pytest.mark.django_db(transaction=True)
def test_a_busy_replica_and_the_last_one_are_never_removed(model: Model, thresholds: Any) -> None:
    a, b = nodes_with_replicas(model, 2)
    first = ready_deployment(model, a)
    t0 = timezone.now()
    with FakeAgents([str(a.id), str(b.id)]):
        queue_pressure(model, first, t0, waited=4.0)
        replicas_autoscale(now=t0)
        queue_pressure(model, first, t0 + timedelta(seconds=6), waited=4.0)
        (added_id,) = replicas_autoscale(now=t0 + timedelta(seconds=6)).added
        admission.queue_leave(
            deployment_id=ids.deployment_id(first.id), job_id=JobId("job-waiting")
        )
        # A running job holds a slot of the added replica: it is busy, not idle.
        t1 = t0 + timedelta(seconds=200)
        assert admission.slot_try(
            deployment_id=DeploymentId(added_id),
            job_id=JobId("job-running"),
            cap=4,
            now=t1.timestamp(),
        )
        for s in (0, 31, 62):
            assert replicas_autoscale(now=t1 + timedelta(seconds=s)).removed == []
        admission.slot_release(deployment_id=DeploymentId(added_id), job_id=JobId("job-running"))
        # The operator stops the first replica: the added one is now the last, and it stays.
        deployment_stop(deployment_id=ids.deployment_id(first.id), now=t1)
        for s in (100, 131, 162):
            assert replicas_autoscale(now=t1 + timedelta(seconds=s)).removed == []
    assert Deployment.objects.get(pk=added_id).state == D.READY
    assert not Event.objects.filter(kind="REPLICA_REMOVED").exists()


def test_no_replica_beyond_the_maximum_nor_where_no_node_can_host_one(
    model: Model, thresholds: Any
) -> None:
    (a,) = nodes_with_replicas(model, 1)
    first = ready_deployment(model, a)
    t0 = timezone.now()
    for s in (0, 6, 12):
        queue_pressure(model, first, t0 + timedelta(seconds=s), waited=4.0)
        report = replicas_autoscale(now=t0 + timedelta(seconds=s))
        assert report.added == []
    assert "no node can host another copy" in report.blocked["smol"]
    assert str(a.id) in report.blocked["smol"]  # the node that serves it is excluded
    thresholds.REPLICA_MAX_PER_MODEL = 1
    report = replicas_autoscale(now=t0 + timedelta(seconds=18))
    assert "REPLICA_MAX_PER_MODEL 1" in report.blocked["smol"]
    assert Deployment.objects.filter(model=model).count() == 1
    assert get_redis().hget(autoscale_key(ids.model_id(model.id)), "above_since") is not None


def test_a_short_burst_of_queueing_adds_no_replica(model: Model, thresholds: Any) -> None:
    a, _ = nodes_with_replicas(model, 2)
    first = ready_deployment(model, a)
    t0 = timezone.now()
    queue_pressure(model, first, t0, waited=4.0)
    replicas_autoscale(now=t0)
    admission.queue_leave(deployment_id=ids.deployment_id(first.id), job_id=JobId("job-waiting"))
    # Nobody waits at the next passes: the pressure run is broken and restarts from zero.
    assert replicas_autoscale(now=t0 + timedelta(seconds=3)).added == []
    queue_pressure(model, first, t0 + timedelta(seconds=6), waited=4.0)
    assert replicas_autoscale(now=t0 + timedelta(seconds=6)).added == []
    assert Deployment.objects.filter(model=model).count() == 1


# --- visible ------------------------------------------------------------------------------------


def test_deployments_rest_output_shows_replicas_slots_in_use_and_queue_depth(
    client: Client, model: Model
) -> None:
    a, b = nodes_with_replicas(model, 2)
    d1, d2 = ready_deployment(model, a), ready_deployment(model, b)
    Deployment.objects.filter(pk__in=[d1.pk, d2.pk]).update(n_parallel=4)
    for job in ("j1", "j2", "j3"):
        assert admission.slot_try(deployment_id=ids.deployment_id(d1.id), job_id=JobId(job), cap=4)
    admission.queue_join(
        deployment_id=ids.deployment_id(d2.id),
        job_id=JobId("w1"),
        priority=1,
        model_id=ids.model_id(model.id),
    )
    rows = {r["id"]: r for r in client.get("/api/admin/deployments", headers=OPERATOR).json()}
    one, two = rows[str(d1.id)], rows[str(d2.id)]
    assert (one["slots_in_use"], one["n_parallel"], one["queue_depth"]) == (3, 4, 0)
    assert (two["slots_in_use"], two["queue_depth"]) == (0, 1)
    assert one["replicas"] == two["replicas"] == 2
    assert one["model_queue_depth"] == 1
    detail = client.get(f"/api/admin/deployments/{d1.id}", headers=OPERATOR).json()
    assert (detail["slots_in_use"], detail["replicas"]) == (3, 2)


def test_a_vllm_replicas_copy_is_planned_from_its_directory(model: Model) -> None:
    """The autoscaler copies the newest replica's request, engine included: a vLLM replica's copy
    is planned and recorded with the model's safetensors directory, not its GGUF."""
    from apps.jobs.autoscale import _replica_add
    from tests.factories import ModelFileFactory, hardware_profile

    directory = ModelFileFactory(
        model=model,
        file_name="smol-st",
        format="safetensors",
        quantization="bfloat16",
        size=270_000_000,
        n_layer=30,
        n_embd=576,
        n_head=9,
        n_head_kv=3,
    )
    # A GGUF that would not fit a node as vLLM loads a directory: planning the copy from it
    # instead of the directory would refuse the copy.
    model.files.exclude(pk=directory.pk).update(size=64 * GiB)
    a = NodeFactory(name="va", hardware={**hardware_profile(), "engines": ["llamacpp", "vllm"]})
    NodeFactory(name="vb", hardware={**hardware_profile(), "engines": ["llamacpp", "vllm"]})
    first = DeploymentFactory(
        model=model,
        model_file=directory,
        engine="vllm",
        primary=a,
        n_parallel=8,
        n_ctx=512,
        request=placement_request_from({"engine": "vllm", "n_ctx": 512, "n_parallel": 8}).to_dict(),
    )
    first.nodes.set([a])
    dep, why = _replica_add(model=model, serving=[first], now=timezone.now(), wait=5.0, depth=2)
    assert dep is not None, why
    dep.refresh_from_db()
    assert dep.engine == "vllm" and dep.model_file_id == directory.id
