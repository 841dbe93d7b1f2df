"""Who drained a node (issue 28, item 2): a node's own LENDING_RESUMED lifts only the drain its own
LENDING_PAUSED began, never an operator's. The node speaks through /api/agent/reports with its
own credential, the operator through the admin API."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.nodes.models import Node
from apps.nodes.states import DRAIN_STATES, NodeState
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db
S = NodeState


def node_says(client: Client, node: Any, event: str) -> None:
    resp = client.post(
        "/api/agent/reports",
        {
            "id": uuid.uuid4().hex,
            "kind": "event",
            "payload": {"event": event, "message": event.lower(), "data": {"handoff": "finish"}},
        },
        content_type="application/json",
        headers={"Authorization": f"Node {node.pk}:cred"},
    )
    assert resp.status_code == 202, resp.content


@pytest.fixture
def operator() -> Client:
    c = Client()
    c.force_login(
        get_user_model().objects.create_user("op-drain", password="pw-test-123", is_staff=True)
    )
    return c


def drained(node: Any) -> bool:
    n = Node.objects.get(pk=node.pk)
    return n.drain_requested and n.state in DRAIN_STATES


def test_a_nodes_resume_never_lifts_an_operators_drain(client: Client, operator: Client) -> None:
    node = NodeFactory()
    assert operator.post(f"/api/admin/nodes/{node.pk}/drain").status_code == 200
    assert drained(node)
    node_says(client, node, "LENDING_PAUSED")
    node_says(client, node, "LENDING_RESUMED")
    assert drained(node)
    assert Node.objects.get(pk=node.pk).drain_requested_by == "operator"


def test_an_operators_drain_during_a_pause_outlives_the_nodes_resume(
    client: Client, operator: Client
) -> None:
    node = NodeFactory()
    node_says(client, node, "LENDING_PAUSED")
    assert drained(node)
    assert Node.objects.get(pk=node.pk).drain_requested_by == "lending"
    assert operator.post(f"/api/admin/nodes/{node.pk}/drain").status_code == 200
    node_says(client, node, "LENDING_RESUMED")
    assert drained(node)
    # The operator lifts it.
    assert operator.post(f"/api/admin/nodes/{node.pk}/undrain").status_code == 200
    n = Node.objects.get(pk=node.pk)
    assert not n.drain_requested and n.state == S.READY and n.drain_requested_by == ""


def test_a_nodes_resume_lifts_the_drain_its_own_pause_began(client: Client) -> None:
    node = NodeFactory()
    node_says(client, node, "LENDING_PAUSED")
    assert drained(node)
    node_says(client, node, "LENDING_RESUMED")
    n = Node.objects.get(pk=node.pk)
    assert not n.drain_requested and n.state == S.READY
