"""What a node's reports can make the controller store (issue 28, item 2): each test sends the
hostile report to /api/agent/reports with the node's own credential and asserts the refusal, its
reason in the API's error format, and that nothing was stored."""

from __future__ import annotations

import ast
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from apps.jobs.reports import AGENT_EVENTS
from apps.nodes.links import LINKS_KEY
from apps.nodes.models import Event
from racon.redis import get_redis
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def report(client: Client, node: Any, kind: str, payload: dict[str, Any]) -> Any:
    body = {"id": uuid.uuid4().hex, "kind": kind, "payload": payload}
    return client.post(
        "/api/agent/reports",
        body,
        content_type="application/json",
        headers={"Authorization": f"Node {node.pk}:cred"},
    )


@pytest.mark.parametrize(
    "name", ["NODE_REVOKED", "SPEED_VERIFIED", "KV_STATE_MOVED", "NODE_ENROLLED", "ANYTHING"]
)
def test_an_event_kind_the_agent_never_sends_is_refused_and_not_stored(
    client: Client, name: str
) -> None:
    node = NodeFactory()
    resp = report(client, node, "event", {"event": name, "message": "forged", "data": {}})
    assert resp.status_code == 400, resp.content
    error = resp.json()["error"]
    assert error["code"] == "invalid_report" and name in error["message"]
    assert not Event.objects.filter(kind=name).exists()


def _agent_event_names() -> set[str]:
    """Every event name agent/ sends: outbox.event("X", ...), on_event("X", ...) and
    _safe(self.on_event, "X", ...)."""
    names = set()
    for path in Path(__file__).resolve().parents[2].joinpath("agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = node.args
            if called == "_safe" and args and getattr(args[0], "attr", "") == "on_event":
                args = args[1:]
            elif called not in ("event", "on_event"):
                continue
            if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                names.add(args[0].value)
    return names


def test_every_event_the_agent_sends_is_allowed() -> None:
    sent = _agent_event_names()
    assert {"AGENT_STARTED", "RUNTIME_FAILED", "LENDING_RESUMED"} <= sent  # the scan works
    assert sent - set(AGENT_EVENTS) == set()


def test_an_event_the_agent_sends_is_still_stored(client: Client) -> None:
    node = NodeFactory()
    resp = report(
        client,
        node,
        "event",
        {"event": "RPC_WORKER_STARTED", "message": "up", "data": {"endpoint": "127.0.0.1:1"}},
    )
    assert resp.status_code == 202, resp.content
    assert Event.objects.get(kind="RPC_WORKER_STARTED").node_id == node.pk


def test_event_data_over_the_cap_is_refused_and_not_stored(client: Client, settings: Any) -> None:
    settings.AGENT_EVENT_DATA_MAX_BYTES = 4096
    node = NodeFactory()
    data = {"log_tail": "x" * 100_000}
    resp = report(client, node, "event", {"event": "RPC_WORKER_FAILED", "data": data})
    assert resp.status_code == 400, resp.content
    assert "AGENT_EVENT_DATA_MAX_BYTES" in resp.json()["error"]["message"]
    assert not Event.objects.filter(kind="RPC_WORKER_FAILED").exists()
    small = report(client, node, "event", {"event": "RPC_WORKER_FAILED", "data": {"a": 1}})
    assert small.status_code == 202


def test_reports_past_the_rate_get_429_with_retry_after_and_are_not_applied(
    client: Client, settings: Any
) -> None:
    settings.NODE_REPORT_RATE_PER_MINUTE = 5
    node, other = NodeFactory(), NodeFactory()
    for i in range(5):
        ok = report(client, node, "event", {"event": "RPC_WORKER_STARTED", "message": str(i)})
        assert ok.status_code == 202, ok.content
    refused = report(client, node, "event", {"event": "RPC_WORKER_STARTED", "message": "6"})
    assert refused.status_code == 429, refused.content
    assert refused.json()["error"]["code"] == "rate_limited"
    assert "NODE_REPORT_RATE_PER_MINUTE" in refused.json()["error"]["message"]
    assert int(refused["Retry-After"]) >= 1
    assert Event.objects.filter(kind="RPC_WORKER_STARTED", node_id=node.pk).count() == 5
    # Per node: another node is still heard.
    assert report(client, other, "event", {"event": "RPC_WORKER_STARTED"}).status_code == 202


def test_a_links_report_stores_only_links_to_live_nodes(client: Client) -> None:
    node, peer = NodeFactory(), NodeFactory()
    revoked = NodeFactory(revoked_at="2026-01-01T00:00:00Z")
    links = [
        {"node_id": str(peer.pk), "rtt_ms": 1.0, "bandwidth_mbps": 100.0},
        {"node_id": str(uuid.uuid4()), "rtt_ms": 1.0, "bandwidth_mbps": 100.0},
        {"node_id": "x" * 5000, "rtt_ms": 1.0, "bandwidth_mbps": 100.0},
        {"node_id": "../../racon:cmd", "rtt_ms": 1.0, "bandwidth_mbps": 100.0},
        {"node_id": str(revoked.pk), "rtt_ms": 1.0, "bandwidth_mbps": 100.0},
    ]
    resp = report(client, node, "links", {"links": links})
    assert resp.status_code == 202, resp.content
    assert resp.json()["stored"] == 1
    stored = get_redis().hgetall(LINKS_KEY)
    assert list(stored) == [f"{node.pk}|{peer.pk}"]
    assert json.loads(stored[f"{node.pk}|{peer.pk}"])["rtt_ms"] == 1.0
