"""What /api/agent/self tells the desktop app about failed challenges (its "a challenge failed"
notification): the node's newest *_CHALLENGE_FAILED event, and only its own."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.nodes.models import Event, EventCategory, Node
from tests.factories import NodeFactory

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.credits.urls")]


def _failed(node: Node, kind: str, message: str, ago: int) -> Event:
    return Event.objects.create(
        kind=kind, category=EventCategory.SECURITY, node=node, message=message,
        created_at=timezone.now() - timedelta(seconds=ago),
    )  # fmt: skip


def test_self_names_the_newest_failed_challenge(client: Client) -> None:
    node, other = NodeFactory(), NodeFactory()
    auth: dict[str, Any] = {"HTTP_AUTHORIZATION": f"Node {node.id}:cred"}
    assert client.get("/api/agent/self", **auth).json()["last_challenge_failure"] is None
    _failed(node, "SPEED_CHALLENGE_FAILED", "claimed 90 GFLOPS, measured 3", ago=60)
    newest = _failed(node, "REPLICA_CHALLENGE_FAILED", "the copy's hash differs", ago=5)
    _failed(other, "SPEED_CHALLENGE_FAILED", "another node's", ago=0)
    Event.objects.create(
        kind="SPEED_CHALLENGE_PASSED", category=EventCategory.SECURITY, node=node,
        created_at=timezone.now(),
    )  # fmt: skip
    got = client.get("/api/agent/self", **auth).json()["last_challenge_failure"]
    assert got["id"] == newest.id
    assert (got["kind"], got["message"]) == ("REPLICA_CHALLENGE_FAILED", "the copy's hash differs")
