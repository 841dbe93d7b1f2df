"""A resumed agent's engines reach the inventory (issue 30): `make run` started again with
RACON_ENGINES=llamacpp,vllm sends HARDWARE_UPDATED at its start, and the node then offers vLLM
(found by hand: a resumed local agent kept the engines it enrolled with, so `racon deploy --engine
vllm` said no node had the engine). A claim: only known names, refused by name otherwise."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.test import Client

from apps.nodes.models import Event, Node
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def hardware_updated(client: Client, node: Node, engines: Any) -> Any:
    return client.post(
        "/api/agent/reports",
        {
            "id": uuid.uuid4().hex,
            "kind": "event",
            "payload": {
                "event": "HARDWARE_UPDATED",
                "message": "hardware inventory at agent start",
                "data": {"hardware": {**(node.hardware or {}), "engines": engines}},
            },
        },
        content_type="application/json",
        headers={"Authorization": f"Node {node.pk}:cred"},
    )


def test_a_resumed_agent_with_vllm_offers_it_and_without_it_no_longer(client: Client) -> None:
    node = NodeFactory()
    assert (node.hardware or {}).get("engines", ["llamacpp"]) == ["llamacpp"]
    assert hardware_updated(client, node, ["llamacpp", "vllm"]).status_code == 202
    node.refresh_from_db()
    assert node.hardware["engines"] == ["llamacpp", "vllm"]
    changed = Event.objects.get(node=node, kind="NODE_ENGINES_CHANGED")
    assert changed.data == {"before": ["llamacpp"], "engines": ["llamacpp", "vllm"]}
    assert hardware_updated(client, node, ["llamacpp", "vllm"]).status_code == 202
    assert Event.objects.filter(node=node, kind="NODE_ENGINES_CHANGED").count() == 1
    assert hardware_updated(client, node, ["llamacpp"]).status_code == 202
    node.refresh_from_db()
    assert node.hardware["engines"] == ["llamacpp"]


@pytest.mark.parametrize(
    ("engines", "words"),
    [(["llamacpp", "tensorrt"], "unknown engine 'tensorrt'"), ("vllm", "must be a list"), ([], "")],
)
def test_an_unknown_engine_is_refused_by_name_and_nothing_changes(
    client: Client, engines: Any, words: str
) -> None:
    node = NodeFactory()
    before = node.hardware
    resp = hardware_updated(client, node, engines)
    assert resp.status_code == 400, resp.content
    assert words in resp.json()["error"]["message"]
    node.refresh_from_db()
    assert node.hardware == before
