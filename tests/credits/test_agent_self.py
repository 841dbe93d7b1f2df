"""The node-scoped endpoints the desktop app uses with the node's own credential (issue 31,
apps/api/agent_self.py): its earnings are the rows of /api/credits/earnings?node=, its lending
policy is read and set with the web form's validation and error texts, and nothing else opens
them (no credential, another node's, a revoked one)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.protocol import node_queue_key
from apps.nodes.models import Node
from racon.redis import get_redis
from tests.factories import NodeFactory, key_for

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.credits.urls")]
GiB = 1024**3


def node_auth(node: Node, credential: str = "cred") -> dict[str, Any]:
    return {"HTTP_AUTHORIZATION": f"Node {node.id}:{credential}"}


def test_a_nodes_earnings_are_the_accounts_rows_for_that_node(
    client: Client,
    earned: dict[str, Any],
) -> None:
    for node in (earned["a"], earned["b"]):
        mine = client.get("/api/agent/earnings?days=30", **node_auth(node))
        assert mine.status_code == 200, mine.content
        theirs = client.get(
            f"/api/credits/earnings?days=30&node={node.id}", **key_for(earned["owner"])
        )
        assert theirs.status_code == 200
        assert mine.json() == theirs.json()
        assert mine.json() and {r["node"] for r in mine.json()} == {str(node.id)}
    # The 40-day-old job shows with days=366 only.
    longer = client.get("/api/agent/earnings?days=366", **node_auth(earned["a"])).json()
    assert sum(r["jobs"] for r in longer) == 4


@pytest.mark.parametrize(
    ("query", "message"),
    [("?days=x", "days: must be a whole number"), ("?days=0", "days: must be between 1 and 366")],
)
def test_bad_days_are_named(client: Client, query: str, message: str) -> None:
    node = NodeFactory()
    resp = client.get(f"/api/agent/earnings{query}", **node_auth(node))
    assert resp.status_code == 400
    assert resp.json()["error"] == {"message": message, "field": "days"}


@pytest.mark.parametrize("path", ["/api/agent/earnings", "/api/agent/lending", "/api/agent/self"])
def test_only_the_nodes_own_credential_opens_them(client: Client, path: str) -> None:
    node = NodeFactory()
    assert client.get(path).status_code == 401
    assert client.get(path, **node_auth(node, "wrong")).status_code == 401
    assert client.get(path, HTTP_AUTHORIZATION="Node not-a-uuid:cred").status_code == 401
    node.revoked_at = timezone.now()
    node.save(update_fields=["revoked_at"])
    resp = client.get(path, **node_auth(node))
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "node_revoked"


def test_self_names_the_state_and_what_the_node_lends(client: Client) -> None:
    node = NodeFactory(state="READY")
    resp = client.get("/api/agent/self", **node_auth(node))
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["state"] == "READY" and body["id"] == str(node.id)
    assert body["lends"]["threads"] == 8 and body["lends"]["ram_bytes"] == 16 * GiB
    assert body["jobs_today"] == 0


GOOD = {
    "timezone": "Europe/Paris",
    "windows": "mon-fri 19:00-08:00\nsat,sun 00:00-24:00",
    "handoff": "finish",
    "idle_minutes": "10",
    "cpu_below": "25",
    "ram_gb": "4",
    "vram_gb": "",
    "threads": "2",
}


def test_the_node_sets_its_policy_it_is_stored_and_pushed(
    client: Client, django_capture_on_commit_callbacks: Any
) -> None:
    node = NodeFactory()
    get_redis().delete(node_queue_key(str(node.id)))
    with django_capture_on_commit_callbacks(execute=True):
        resp = client.put(
            "/api/agent/lending", json.dumps(GOOD), content_type="application/json",
            **node_auth(node),
        )  # fmt: skip
    assert resp.status_code == 200, resp.content
    node.refresh_from_db()
    assert node.lending["policy"]["caps"] == {
        "ram_bytes": 4 * GiB,
        "vram_bytes": None,
        "threads": 2,
    }
    assert node.lending["source"] == "owner"
    assert resp.json()["form"]["ram_gb"] == "4" and resp.json()["form"]["threads"] == "2"
    queued = [json.loads(c) for c in get_redis().lrange(node_queue_key(str(node.id)), 0, -1)]
    assert [c["kind"] for c in queued] == ["set_lending"]
    # And reading it back gives the same.
    again = client.get("/api/agent/lending", **node_auth(node)).json()
    assert again["policy"] == node.lending["policy"]
    get_redis().delete(node_queue_key(str(node.id)))


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"windows": "someday 7-8"}, "windows", "is not a window like"),
        ({"timezone": "Mars/Olympus"}, "timezone", "Mars/Olympus"),
        ({"handoff": "explode"}, "handoff", "explode"),
        ({"ram_gb": "9999"}, "ram_gb", "ram"),
        ({"threads": "-1"}, "threads", "threads"),
    ],
)
def test_a_refused_policy_names_the_field_with_the_web_forms_text(
    client: Client, change: dict[str, str], field: str, words: str
) -> None:
    node = NodeFactory()
    before = node.lending
    resp = client.put(
        "/api/agent/lending", json.dumps({**GOOD, **change}), content_type="application/json",
        **node_auth(node),
    )  # fmt: skip
    assert resp.status_code == 422, resp.content
    err = resp.json()["error"]
    assert err["field"] == field and words in err["message"]
    node.refresh_from_db()
    assert node.lending == before  # nothing stored


def test_the_same_text_as_the_web_form(client: Client) -> None:
    """The web form (apps/api/ui_lending.py) and this endpoint run one check: same message."""
    from agent.lending import PolicyError, policy_from_document
    from apps.api.ui_lending import lending_document

    bad = {**GOOD, "windows": "mon-fri 19:00-08:00\nnever"}
    with pytest.raises(PolicyError) as exc:
        policy_from_document(lending_document(bad))
    node = NodeFactory()
    resp = client.put(
        "/api/agent/lending", json.dumps(bad), content_type="application/json", **node_auth(node)
    )
    assert resp.status_code == 422 and resp.json()["error"]["message"] == str(exc.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[1, 2]", "the body must be a JSON object of the form's fields"),
        ('{"path": "/etc/passwd"}', "unknown field(s) path"),
    ],
)
def test_a_malformed_body_is_refused(client: Client, body: str, message: str) -> None:
    node = NodeFactory()
    resp = client.put(
        "/api/agent/lending", body, content_type="application/json", **node_auth(node)
    )
    assert resp.status_code == 400 and message in resp.json()["error"]["message"]
