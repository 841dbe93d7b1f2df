"""An agent's reports (one per job) are authenticated against the heartbeat mirror in Redis, not
a Node row read each time (apps/nodes/enrollment.node_authenticate_id): the same answers as the
database's check, a cold mirror rebuilt, and a revocation seen at once."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.nodes.enrollment import node_revoke
from apps.nodes.models import Event, Node
from apps.nodes.services import _meta_key
from racon import ids
from racon.redis import get_redis
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


def started(client: Client, auth: str, message: str = "up") -> Any:
    body = {
        "id": uuid.uuid4().hex,
        "kind": "event",
        "payload": {"event": "RPC_WORKER_STARTED", "message": message, "data": {}},
    }
    return client.post(
        "/api/agent/reports", body, content_type="application/json", headers={"Authorization": auth}
    )


def test_a_cold_mirror_is_rebuilt_then_reports_read_no_node_row(client: Client) -> None:
    node = NodeFactory()
    key = _meta_key(ids.node_id(node.pk))
    get_redis().delete(key)
    first = started(client, f"Node {node.pk}:cred", "first")
    assert first.status_code == 202, first.content
    assert get_redis().hget(key, "cred") == node.credential_hash
    node_table = Node._meta.db_table
    with CaptureQueriesContext(connection) as queries:
        second = started(client, f"Node {node.pk}:cred", "second")
    assert second.status_code == 202, second.content
    assert not [q for q in queries.captured_queries if f'FROM "{node_table}"' in q["sql"]]
    assert Event.objects.filter(kind="RPC_WORKER_STARTED", node_id=node.pk).count() == 2


def test_a_wrong_credential_a_revoked_node_and_a_malformed_id_are_401_and_store_nothing(
    client: Client,
) -> None:
    node = NodeFactory()
    assert started(client, f"Node {node.pk}:cred").status_code == 202  # the mirror is warm
    wrong = started(client, f"Node {node.pk}:not-it")
    assert wrong.status_code == 401
    assert wrong.json()["error"] == {
        "message": "invalid node credential",
        "code": "invalid_credential",
    }
    malformed = started(client, "Node not-a-uuid:cred")
    assert malformed.status_code == 401
    assert malformed.json()["error"]["code"] == "malformed_node_id"
    unknown = started(client, f"Node {uuid.uuid4()}:cred")
    assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "unknown_node"
    node_revoke(node_id=ids.node_id(node.pk), now=timezone.now())
    for _ in range(2):  # the first rebuilds the dropped mirror (credential ""), the second reads it
        gone = started(client, f"Node {node.pk}:cred")
        assert gone.status_code == 401 and gone.json()["error"]["code"] == "node_revoked"
        assert get_redis().hget(_meta_key(ids.node_id(node.pk)), "cred") == ""
    assert Event.objects.filter(kind="RPC_WORKER_STARTED").count() == 1
