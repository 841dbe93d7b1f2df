"""POST /api/agent/redis: a node asks for its Redis URL again (its controller's Redis restarted on
another port, without the node's user); only with its own credential."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.nodes.enrollment import node_revoke
from racon import ids
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def ask(client: Client, auth: str | None) -> Any:
    headers = {"Authorization": auth} if auth else {}
    return client.post("/api/agent/redis", headers=headers)


def test_a_node_gets_the_url_its_controller_hands_nodes_now(client: Client, settings: Any) -> None:
    settings.NODE_REDIS_ACL = False
    settings.AGENT_REDIS_URL = "redis://127.0.0.1:40123/0"
    node = NodeFactory()
    resp = ask(client, f"Node {node.pk}:cred")
    assert resp.status_code == 200, resp.content
    assert resp.json() == {"redis_url": "redis://127.0.0.1:40123/0"}


def test_no_credential_a_wrong_one_or_a_revoked_node_is_401_with_its_code(client: Client) -> None:
    node = NodeFactory()
    assert ask(client, None).json()["error"]["code"] == "missing_credential"
    wrong = ask(client, f"Node {node.pk}:not-it")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_credential"
    node_revoke(node_id=ids.node_id(node.pk), now=timezone.now())
    gone = ask(client, f"Node {node.pk}:cred")
    assert gone.status_code == 401 and gone.json()["error"]["code"] == "node_revoked"
