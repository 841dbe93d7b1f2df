"""Admin API: authentication, staff rights, 404s, filters, drain, tokens, events, health."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.api.auth import api_key_create
from apps.nodes.models import Event, Node
from apps.nodes.states import NodeState
from racon import ids
from tests.factories import AccountFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


def test_admin_endpoints_need_credentials(client: Client) -> None:
    assert client.get("/api/admin/nodes").status_code in (401, 403)
    assert (
        client.get("/api/admin/nodes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    )


def test_non_staff_key_and_session_get_403(client: Client) -> None:
    acct = AccountFactory()
    _, key = api_key_create(name="k", account_id=ids.account_id(acct.id), scopes=["inference"])
    assert (
        client.get("/api/admin/nodes", headers={"Authorization": f"Bearer {key}"}).status_code
        == 403
    )
    user = UserFactory()
    client.force_login(user)
    assert client.get("/api/admin/nodes").status_code == 403


def test_staff_session_and_admin_scoped_key_are_allowed(client: Client) -> None:
    acct = AccountFactory()
    _, key = api_key_create(name="k", account_id=ids.account_id(acct.id), scopes=["admin"])
    assert (
        client.get("/api/admin/nodes", headers={"Authorization": f"Bearer {key}"}).status_code
        == 200
    )
    client.force_login(UserFactory(is_staff=True))
    assert client.get("/api/admin/nodes").status_code == 200


def test_revoked_key_is_refused(client: Client) -> None:
    from apps.api.auth import api_key_revoke

    k, key = api_key_create(
        name="k", account_id=ids.account_id(AccountFactory().id), scopes=["admin"]
    )
    api_key_revoke(key_id=ids.api_key_id(k.id))
    assert (
        client.get("/api/admin/nodes", headers={"Authorization": f"Bearer {key}"}).status_code
        == 401
    )


def test_node_list_filters_by_state_and_name(client: Client) -> None:
    NodeFactory(name="gpu-box", state=NodeState.READY)
    NodeFactory(name="laptop", state=NodeState.OFFLINE)

    def names(q: str) -> list[str]:
        return sorted(
            n["name"] for n in client.get(f"/api/admin/nodes{q}", headers=OPERATOR).json()
        )

    assert names("") == ["gpu-box", "laptop"]
    assert names("?state=OFFLINE") == ["laptop"]
    assert names("?name=gpu") == ["gpu-box"]
    assert client.get("/api/admin/nodes?state=SLEEPY", headers=OPERATOR).status_code == 400


def test_unknown_node_ids_get_404(client: Client) -> None:
    missing = uuid.uuid4()
    for path in (
        f"/api/admin/nodes/{missing}",
        f"/api/admin/jobs/{missing}",
        f"/api/admin/deployments/{missing}",
    ):
        assert client.get(path, headers=OPERATOR).status_code == 404, path
    for path in (
        f"/api/admin/nodes/{missing}/drain",
        f"/api/admin/nodes/{missing}/undrain",
        f"/api/admin/jobs/{missing}/cancel",
    ):
        resp = client.post(path, headers=OPERATOR)
        assert resp.status_code == 404, path
        assert resp.json()["error"]["message"]


def test_node_detail_has_hardware_and_recent_events(client: Client) -> None:
    node = NodeFactory()
    Event.objects.create(
        kind="NODE_ENROLLED",
        category="LIFECYCLE",
        node=node,
        message="hi",
        created_at=timezone.now(),
    )
    body = client.get(f"/api/admin/nodes/{node.id}", headers=OPERATOR).json()
    assert body["hardware"]["cpu"]["logical_cores"] == 8
    assert [e["kind"] for e in body["events"]] == ["NODE_ENROLLED"]


def test_drain_without_running_work_writes_node_drained_and_undrain_restores(
    client: Client,
) -> None:
    node = NodeFactory(state=NodeState.READY)
    resp = client.post(f"/api/admin/nodes/{node.id}/drain", headers=OPERATOR)
    assert resp.status_code == 200 and resp.json()["state"] == NodeState.DRAINED
    assert Event.objects.filter(node=node, kind="NODE_DRAINED").count() == 1
    assert "drained_at" not in resp.json()  # the state says it
    resp = client.post(f"/api/admin/nodes/{node.id}/undrain", headers=OPERATOR)
    assert resp.json()["state"] == NodeState.READY
    assert Node.objects.get(pk=node.id).drain_requested is False


def test_token_create_shows_plaintext_and_command_once_then_list_and_revoke(client: Client) -> None:
    resp = client.post(
        "/api/admin/tokens",
        {"label": "office", "max_uses": 2},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 201
    body = resp.json()
    assert body["token"].startswith("rcn_") and body["token"] in body["command"]
    # In the environment, never in argv (issue 24).
    assert body["command"].startswith(f"RACON_ENROLLMENT_TOKEN={body['token']} node-agent ")
    assert "--enrollment-token" not in body["command"]
    listed = client.get("/api/admin/tokens", headers=OPERATOR).json()
    assert "token" not in listed[0] and listed[0]["status"] == "active"
    revoked = client.post(f"/api/admin/tokens/{body['id']}/revoke", headers=OPERATOR).json()
    assert revoked["status"] == "revoked"
    bad = client.post(
        "/api/admin/tokens",
        {"label": "", "max_uses": 0},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert bad.status_code == 400 and {"label", "max_uses"} <= set(bad.json()["error"]["fields"])


def test_events_filter_by_kind_node_and_time(client: Client) -> None:
    a, b = NodeFactory(), NodeFactory()
    t = timezone.now()
    Event.objects.create(kind="NODE_ENROLLED", category="LIFECYCLE", node=a, created_at=t)
    Event.objects.create(kind="HEARTBEAT_TIMEOUT", category="HEALTH", node=b, created_at=t)

    def kinds(q: str) -> list[str]:
        return [e["kind"] for e in client.get(f"/api/admin/events{q}", headers=OPERATOR).json()]

    assert kinds("?kind=HEARTBEAT_TIMEOUT") == ["HEARTBEAT_TIMEOUT"]
    assert kinds(f"?node={a.id}") == ["NODE_ENROLLED"]
    assert client.get("/api/admin/events?since=yesterday", headers=OPERATOR).status_code == 400


def test_jobs_list_rejects_unknown_state(client: Client) -> None:
    assert client.get("/api/admin/jobs", headers=OPERATOR).json() == []
    assert client.get("/api/admin/jobs?state=NOPE", headers=OPERATOR).status_code == 400


def test_health_reports_database_redis_and_celery(client: Client) -> None:
    from racon.redis import get_redis

    resp = client.get("/health")
    assert resp.status_code == 503  # no Celery worker has checked in
    assert resp.json()["checks"]["database"]["ok"] and resp.json()["checks"]["redis"]["ok"]
    get_redis().set("racon:celery:alive", __import__("time").time())
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_openapi_schema_is_served_and_lists_the_endpoints(client: Client) -> None:
    resp = client.get("/api/schema/?format=json", headers=OPERATOR)
    assert resp.status_code == 200
    paths = resp.json()["paths"]
    for p in (
        "/api/admin/nodes",
        "/api/admin/nodes/{node_id}/drain",
        "/api/admin/deployments/preview",
        "/api/agent/enroll",
        "/api/credits/balance",
    ):
        assert p in paths, p
    assert client.get("/api/docs/", headers=OPERATOR).status_code == 200


def _unused(x: Any) -> None:
    return None
