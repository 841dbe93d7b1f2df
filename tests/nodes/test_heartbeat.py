from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.protocol import PROTOCOL_VERSION
from apps.nodes.enrollment import enrollment_token_issue, node_revoke
from apps.nodes.models import Event, Node
from apps.nodes.services import node_drain, node_health_sweep
from apps.nodes.states import NodeState
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis
from tests.factories import AccountFactory, hardware_profile

pytestmark = pytest.mark.django_db
S = NodeState
_PORTS = itertools.count(20000)


def enroll(client: Client, name: str = "box", machine: str | None = None) -> tuple[str, str]:
    """Each node its own loopback port: an address and port pair belongs to one node."""
    acct = AccountFactory()
    _, token = enrollment_token_issue(
        account_id=ids.account_id(acct.id), label="t", now=timezone.now(), max_uses=100
    )
    resp = client.post(
        "/api/agent/enroll",
        {
            "token": token,
            "node_name": name,
            "machine_id": machine or name,
            "agent_version": "0.1.0",
            "protocol_version": PROTOCOL_VERSION,
            "advertise_address": "127.0.0.1",
            "rpc_port": next(_PORTS),
            "hardware": hardware_profile(),
        },
        content_type="application/json",
    )
    assert resp.status_code == 201, resp.content
    return resp.json()["node_id"], resp.json()["credential"]


def beat(client: Client, node_id: str, cred: str, **body: Any) -> Any:
    body.setdefault("telemetry", {"cpu_percent": 5.0, "mem_available": 1024})
    body.setdefault("protocol_version", PROTOCOL_VERSION)
    return client.post(
        "/api/agent/heartbeat",
        body,
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    )


def test_first_ready_heartbeat_makes_node_schedulable(client: Client) -> None:
    node_id, cred = enroll(client)
    assert beat(client, node_id, cred).json()["state"] == S.REGISTERING
    resp = beat(client, node_id, cred, state="READY")
    assert resp.status_code == 200
    assert resp.json()["state"] == S.READY
    assert Node.objects.get(pk=node_id).state == S.READY


def test_steady_heartbeat_costs_no_database_query(
    client: Client, django_assert_num_queries: Any
) -> None:
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY")
    with django_assert_num_queries(0):
        resp = beat(client, node_id, cred, state="READY")
    assert resp.status_code == 200


def test_sweep_marks_late_nodes_degraded_then_offline_and_heartbeat_restores(
    client: Client, settings: Any
) -> None:
    settings.HEARTBEAT_INTERVAL = 5
    settings.MASS_FAILURE_MIN_NODES = 100  # one node: the guard must not interfere
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY")
    t0 = timezone.now()
    assert node_health_sweep(now=t0 + timedelta(seconds=10)).degraded == []
    assert node_health_sweep(now=t0 + timedelta(seconds=16)).degraded == [node_id]
    assert Node.objects.get(pk=node_id).state == S.DEGRADED
    assert node_health_sweep(now=t0 + timedelta(seconds=46)).offline == [node_id]
    assert Node.objects.get(pk=node_id).state == S.OFFLINE
    assert Event.objects.filter(node_id=node_id, kind="HEARTBEAT_TIMEOUT").count() == 2
    assert beat(client, node_id, cred, state="READY").json()["state"] == S.READY
    assert Event.objects.filter(node_id=node_id, kind="HEARTBEAT_RESTORED").count() == 1


def test_heartbeat_times_lost_by_redis_start_the_clock_again_instead_of_offlining_the_node(
    client: Client, settings: Any
) -> None:
    # A Redis restart without persistence (or a flush) loses the scores: the node, READY for a
    # minute, is not judged by that minute-old state change before its next beat.
    settings.HEARTBEAT_INTERVAL = 5
    settings.MASS_FAILURE_MIN_NODES = 100
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY")
    get_redis().delete("racon:hb:last")
    later = timezone.now() + timedelta(seconds=60)
    assert node_health_sweep(now=later) == node_health_sweep(now=later)  # nothing, twice
    assert node_health_sweep(now=later).degraded == []
    assert Node.objects.get(pk=node_id).state == S.READY
    # Still silent from then on: DEGRADED, then OFFLINE, on the usual thresholds.
    assert node_health_sweep(now=later + timedelta(seconds=16)).degraded == [node_id]
    assert node_health_sweep(now=later + timedelta(seconds=46)).offline == [node_id]


def test_a_mirror_lost_again_while_it_is_rebuilt_is_a_retry_not_a_revocation(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis flushed (or restarted) twice in a row: once before a beat, once between the mirror's
    rebuild and the retry. Only the database says a node is revoked: the beat is a 503 the agent
    retries, never the 401 'revoked' that stops it (as tests/e2e flushing Redis between tests
    could make it)."""
    from apps.nodes import heartbeats

    node_id, cred = enroll(client)
    assert beat(client, node_id, cred, state="READY").status_code == 200
    rebuild = heartbeats._meta_from_db

    def rebuilt_then_lost(nid: str) -> Any:
        got = rebuild(NodeId(nid))
        get_redis().flushdb()  # the second flush, between the rebuild and the retry
        return got

    monkeypatch.setattr(heartbeats, "_meta_from_db", rebuilt_then_lost)
    get_redis().flushdb()
    resp = beat(client, node_id, cred, state="READY")
    assert resp.status_code == 503, resp.content
    assert resp.json()["error"]["code"] == "mirror_lost" and resp["Retry-After"] == "1"
    monkeypatch.setattr(heartbeats, "_meta_from_db", rebuild)
    assert beat(client, node_id, cred, state="READY").status_code == 200
    node = Node.objects.get(pk=node_id)
    assert node.revoked_at is None and node.state == S.READY
    # A revoked node is still refused after a flush: the rebuild reads the database.
    node_revoke(node_id=ids.node_id(node_id), now=timezone.now())
    get_redis().flushdb()
    resp = beat(client, node_id, cred, state="READY")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "node_revoked"


def test_agent_clock_skew_is_ignored(client: Client, settings: Any) -> None:
    settings.MASS_FAILURE_MIN_NODES = 100
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY", sent_at=0.0)  # agent clock at 1970
    assert node_health_sweep(now=timezone.now()).degraded == []
    assert Node.objects.get(pk=node_id).state == S.READY


def test_mass_silence_raises_one_cluster_event_instead_of_offlining_everyone(
    client: Client, settings: Any
) -> None:
    settings.HEARTBEAT_INTERVAL = 5
    settings.MASS_FAILURE_MIN_NODES = 3
    settings.MASS_FAILURE_FRACTION = 0.6
    ids = []
    for i in range(4):
        node_id, cred = enroll(client, name=f"n{i}")
        beat(client, node_id, cred, state="READY")
        ids.append(node_id)
    later = timezone.now() + timedelta(seconds=60)
    result = node_health_sweep(now=later)
    assert result.offline == []
    assert sorted(result.suppressed) == sorted(ids)
    assert not Node.objects.filter(state=S.OFFLINE).exists()
    assert Event.objects.filter(kind="CLUSTER_PARTITION_SUSPECTED").count() == 1
    node_health_sweep(now=later + timedelta(seconds=5))
    assert Event.objects.filter(kind="CLUSTER_PARTITION_SUSPECTED").count() == 1


def test_single_silent_node_among_many_goes_offline(client: Client, settings: Any) -> None:
    settings.HEARTBEAT_INTERVAL = 5
    nodes = []
    for i in range(4):
        nodes.append(enroll(client, name=f"m{i}"))
        beat(client, *nodes[-1], state="READY")
    later = timezone.now() + timedelta(seconds=60)
    for node_id, _cred in nodes[1:]:
        get_redis().zadd("racon:hb:last", {node_id: later.timestamp()})
    result = node_health_sweep(now=later)
    assert result.offline == [nodes[0][0]]


def test_revoked_node_heartbeat_gets_401_and_changes_nothing(client: Client) -> None:
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY")
    node_revoke(node_id=ids.node_id(node_id), now=timezone.now())
    state_before = Node.objects.get(pk=node_id).state
    resp = beat(client, node_id, cred, state="READY")
    assert resp.status_code == 401
    assert "revoked" in resp.json()["error"]["message"]
    assert Node.objects.get(pk=node_id).state == state_before


def test_wrong_credential_and_malformed_heartbeats_are_refused(client: Client) -> None:
    node_id, cred = enroll(client)
    assert beat(client, node_id, "wrong").status_code == 401
    assert (
        client.post("/api/agent/heartbeat", {}, content_type="application/json").status_code == 401
    )
    bad = client.post(
        "/api/agent/heartbeat",
        "nope",
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    )
    assert bad.status_code == 400
    assert beat(client, node_id, cred, state="SLEEPING").status_code == 400
    huge = {"telemetry": {"x": "y" * 300_000}}
    assert beat(client, node_id, cred, **huge).status_code == 413  # over the limit (issue 12)


def test_agent_fatal_fault_moves_node_to_error(client: Client) -> None:
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY")
    assert beat(client, node_id, cred, state="ERROR").json()["state"] == S.ERROR
    assert Event.objects.filter(node_id=node_id, kind="NODE_FAULT").exists()


def test_drained_node_without_work_stays_drained_and_node_drained_is_written_once(
    client: Client,
) -> None:
    node_id, cred = enroll(client)
    beat(client, node_id, cred, state="READY")
    node_drain(node_id=NodeId(node_id), now=timezone.now())
    assert beat(client, node_id, cred, state="READY").json()["state"] == S.DRAINED
    beat(client, node_id, cred, state="READY")
    assert Event.objects.filter(node_id=node_id, kind="NODE_DRAINED").count() == 1
