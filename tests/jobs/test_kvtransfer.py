"""KV state transfer (apps/jobs/kvtransfer.py, kvcache.py): who may upload and download a saved
slot, the size cap, ownership moving with the bytes, reservations, routing waiting for a move,
and the fallback that drops a conversation with an event when its move fails."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import pytest
from django.db import connections
from django.test import Client, override_settings
from django.utils import timezone

from apps.jobs import admission, kvcache, kvtransfer
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from apps.nodes.models import Event
from racon import ids
from racon.ids import JobId
from racon.redis import get_redis
from tests.factories import NodeFactory
from tests.jobs.helpers import chat, deployment, kv_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def model() -> Model:
    return kv_model(name="kvt-model", sha256="e" * 64)


def held_on(model: Model, dep: Deployment, slot: int, *turns: str) -> list[str]:
    """Record that ``slot`` of ``dep`` holds this conversation (a finished job); its chain."""
    chain = kvcache.prefix_chain(model_id=ids.model_id(model.id), kind="chat", params=chat(*turns))
    route = kvcache.Route(deployment=dep, policy="prefix", reason="", chain=chain)
    route.slot, route.slot_deployment_id = slot, str(dep.id)
    kvcache.job_finished(
        route=route,
        job_id=JobId(f"j-{slot}"),
        deployment_id=ids.deployment_id(dep.id),
        completed=True,
        usage={"prompt_tokens": 90, "completion_tokens": 10},
        served_slot=None,
    )
    return chain


def auth(node: Any) -> dict[str, str]:
    return {"Authorization": f"Node {node.pk}:cred"}


def xfer(src: Any, dst: Any) -> str:
    tid = "ab12" * 8
    get_redis().hset(
        kvtransfer.xfer_key(tid),
        mapping={"from_node": str(src.pk), "to_node": str(dst.pk), "state": "awaiting_upload"},
    )
    return tid


def test_only_the_old_owner_uploads_and_only_the_new_owner_downloads(
    client: Client, tmp_path: Any, settings: Any
) -> None:
    settings.VAR_DIR = tmp_path
    src, dst, outsider = NodeFactory(), NodeFactory(), NodeFactory()
    tid = xfer(src, dst)
    blob = bytes(range(256)) * 12 * 1024  # 3 MiB: over the API's body limit, within the KV cap
    url = f"/api/agent/kv/{tid}"
    for who in (outsider, dst):
        refused = client.post(url, blob, content_type="application/octet-stream", headers=auth(who))
        assert refused.status_code == 403, refused.content
        assert "may not upload" in refused.json()["error"]["message"]
    anon = client.post(url, blob, content_type="application/octet-stream")
    assert anon.status_code == 401
    ok = client.post(url, blob, content_type="application/octet-stream", headers=auth(src))
    assert ok.status_code == 201, ok.content
    assert ok.json() == {
        "transfer_id": tid,
        "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    again = client.post(url, blob, content_type="application/octet-stream", headers=auth(src))
    assert again.status_code == 409
    for who in (outsider, src):
        assert client.get(url, headers=auth(who)).status_code == 403
    got = client.get(url, headers=auth(dst))
    assert got.status_code == 200
    assert b"".join(got.streaming_content) == blob  # type: ignore[attr-defined]
    assert got["X-Racon-Sha256"] == hashlib.sha256(blob).hexdigest()
    assert client.get("/api/agent/kv/" + "cd" * 16, headers=auth(dst)).status_code == 404


def test_an_upload_over_the_cap_is_refused_and_nothing_is_stored(
    client: Client, tmp_path: Any, settings: Any
) -> None:
    settings.VAR_DIR = tmp_path
    settings.KV_TRANSFER_MAX_BYTES = 100
    src, dst = NodeFactory(), NodeFactory()
    tid = xfer(src, dst)
    resp = client.post(
        f"/api/agent/kv/{tid}",
        b"x" * 101,
        content_type="application/octet-stream",
        headers=auth(src),
    )
    assert resp.status_code == 413
    assert "limit of 100 bytes" in resp.json()["error"]["message"]
    assert get_redis().hget(kvtransfer.xfer_key(tid), "state") == "awaiting_upload"
    assert not list((tmp_path / "kv-transfers").glob("*"))


def test_a_restored_conversation_moves_its_ownership_and_counts_the_bytes(model: Model) -> None:
    a, b = deployment(model), deployment(model)
    a_id, b_id = ids.deployment_id(a.id), ids.deployment_id(b.id)
    chain = held_on(model, a, 1, "hello")
    held = kvcache.slots_held(deployment_id=a_id)
    assert [(h.slot, h.prefix) for h in held] == [(1, chain[-1])]
    slot = kvcache.slot_reserve(deployment_id=b_id, n_parallel=2, transfer_id="t1", ttl=30)
    assert slot is not None

    def move(n_bytes: int, seconds: float) -> bool:
        return kvcache.conversation_moved(
            held=held[0],
            from_deployment_id=a_id,
            to_deployment_id=b_id,
            to_slot=slot,
            n_bytes=n_bytes,
            seconds=seconds,
            tokens_restored=100,
        )

    assert move(12345, 0.5)
    kvcache.slot_unreserve(deployment_id=b_id, slot=slot, transfer_id="t1")
    owner = kvcache.owner_lookup(
        kvcache.prefix_chain(
            model_id=ids.model_id(model.id), kind="chat", params=chat("hello", "hi", "more")
        )
    )
    assert owner is not None and (owner.deployment_id, owner.slot) == (str(b.id), slot)
    assert kvcache.slots_held(deployment_id=a_id) == []
    st = kvcache.stats()
    assert st["bytes_moved"] == 12345 and st["transfer_seconds"] == 0.5 and st["moved"] == 1
    ev = Event.objects.get(kind="KV_STATE_MOVED")
    assert ev.deployment_id == b.id and ev.data["from_deployment"] == str(a.id)
    assert ev.data["bytes"] == 12345 and ev.data["to_slot"] == slot
    # A second report of the same move finds the old slot no longer naming it: nothing recorded.
    assert not move(1, 0.1)


def test_a_slot_reserved_for_a_restore_is_never_given_to_a_job(model: Model) -> None:
    b = deployment(model, n_parallel=2)
    reserved = kvcache.slot_reserve(
        deployment_id=ids.deployment_id(b.id), n_parallel=2, transfer_id="t2", ttl=30
    )
    assert reserved is not None
    route = kvcache.Route(deployment=b, policy="prefix", reason="miss", chain=["x"])
    for job in ("j1", "j2"):
        assert admission.slot_try(deployment_id=ids.deployment_id(b.id), job_id=JobId(job), cap=3)
    first = kvcache.slot_claim(
        route=route, deployment_id=ids.deployment_id(b.id), job_id=JobId("j1"), n_parallel=2
    )
    assert first is not None and first != reserved
    assert (
        kvcache.slot_claim(
            route=route, deployment_id=ids.deployment_id(b.id), job_id=JobId("j2"), n_parallel=2
        )
        is None
    )
    kvcache.slot_unreserve(deployment_id=ids.deployment_id(b.id), slot=reserved, transfer_id="t2")
    assert (
        kvcache.slot_claim(
            route=route, deployment_id=ids.deployment_id(b.id), job_id=JobId("j2"), n_parallel=2
        )
        == reserved
    )


@pytest.mark.django_db(transaction=True)  # the mover thread writes its event row itself
@override_settings(KV_TRANSFER_WAIT_SECONDS=20)
def test_a_follow_up_waits_for_its_state_to_move_instead_of_dropping_it(model: Model) -> None:
    a, b = deployment(model), deployment(model)
    held_on(model, a, 0, "hello")
    assert kvcache.transfer_begin(deployment_id=ids.deployment_id(a.id), ttl=60)
    assert not kvcache.transfer_begin(
        deployment_id=ids.deployment_id(a.id), ttl=60
    )  # once per replica
    Deployment.objects.filter(pk=a.pk).update(state=DeploymentState.STOPPED)
    held = kvcache.slots_held(deployment_id=ids.deployment_id(a.id))[0]

    def move() -> None:
        time.sleep(0.5)
        kvcache.conversation_moved(
            held=held, from_deployment_id=ids.deployment_id(a.id), to_deployment_id=ids.deployment_id(b.id), to_slot=1,
            n_bytes=10, seconds=0.4, tokens_restored=100,
        )  # fmt: skip
        kvcache.transfer_end(deployment_id=ids.deployment_id(a.id))
        connections.close_all()

    mover = threading.Thread(target=move)
    mover.start()
    try:
        route = kvcache.route_request(
            model_id=ids.model_id(model.id),
            kind="chat",
            params=chat("hello", "hi", "more"),
            cached=False,
        )
    finally:
        mover.join()
    assert route.deployment.id == b.id and route.hit and route.owner is not None
    assert route.owner.slot == 1
    assert not Event.objects.filter(kind="KV_STATE_DROPPED").exists()


@override_settings(KV_TRANSFER_TIMEOUT_SECONDS=1)
def test_a_move_whose_old_owner_never_answers_drops_the_conversation_with_an_event(
    model: Model,
) -> None:
    a, b = deployment(model), deployment(model)
    held_on(model, a, 0, "hello")
    Deployment.objects.filter(pk=a.pk).update(state=DeploymentState.STOPPED)  # routing skips it
    assert kvcache.transfer_begin(deployment_id=ids.deployment_id(a.id), ttl=60)
    out = kvtransfer.deployment_kv_transfer(
        deployment_id=ids.deployment_id(a.id), now=timezone.now()
    )
    assert (out.moved, out.dropped) == (0, 1)
    dropped = Event.objects.get(kind="KV_STATE_DROPPED")
    assert dropped.deployment_id == a.id and "kv_save" in dropped.data["reason"]
    assert kvcache.slots_held(deployment_id=ids.deployment_id(a.id)) == []
    assert kvcache.transfer_state(deployment_id=ids.deployment_id(a.id)) == "done"
    # The save command went to the old owner's primary, and only there.
    assert get_redis().llen(f"racon:n:{a.primary_id}:commands") == 1
    assert get_redis().llen(f"racon:n:{b.primary_id}:commands") == 0
