"""machine_id squatting (issue 28, item 2): machine_id comes from the world-readable
/etc/machine-id, so it names a machine within an account, never across accounts. A contributor who
enrolls a colleague's machine id first holds nothing of the colleague's, and an operator's
allow-reenroll never moves a machine (and its later pay) to another account."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from agent.protocol import PROTOCOL_VERSION
from apps.nodes.enrollment import enrollment_token_issue
from apps.nodes.models import Node
from tests.factories import AccountFactory, hardware_profile

pytestmark = pytest.mark.django_db


def token_of(account: Any) -> str:
    _, plaintext = enrollment_token_issue(
        account_id=account.id, label="t", now=timezone.now(), max_uses=5
    )
    return plaintext


def enroll(client: Client, token: str, *, name: str, port: int) -> Any:
    return client.post(
        "/api/agent/enroll",
        {
            "token": token,
            "node_name": name,
            "machine_id": "colleagues-machine-id",
            "agent_version": "0.1.0",
            "protocol_version": PROTOCOL_VERSION,
            "advertise_address": "10.0.0.5",
            "rpc_port": port,
            "hardware": hardware_profile(),
        },
        content_type="application/json",
    )


def beat(client: Client, node_id: str, cred: str) -> int:
    return client.post(
        "/api/agent/heartbeat",
        {"protocol_version": PROTOCOL_VERSION, "telemetry": {}},
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    ).status_code


def test_a_squatted_machine_id_does_not_stop_its_owner_enrolling_in_their_own_account(
    client: Client,
) -> None:
    squatter, owner = AccountFactory(), AccountFactory()
    first = enroll(client, token_of(squatter), name="squat", port=50060)
    assert first.status_code == 201, first.content
    mine = enroll(client, token_of(owner), name="real", port=50061)
    assert mine.status_code == 201, mine.content
    assert mine.json()["node_id"] != first.json()["node_id"]
    assert Node.objects.get(pk=mine.json()["node_id"]).account_id == owner.id
    squatted = Node.objects.get(pk=first.json()["node_id"])
    assert squatted.account_id == squatter.id and squatted.name == "squat"
    assert beat(client, first.json()["node_id"], first.json()["credential"]) == 200


def test_an_operators_allow_reenroll_never_moves_a_machine_to_another_account(
    client: Client,
) -> None:
    squatter, owner = AccountFactory(), AccountFactory()
    first = enroll(client, token_of(squatter), name="squat", port=50062).json()
    op = get_user_model().objects.create_user("op-m", password="pw-test-123", is_staff=True)
    client.force_login(op)
    assert client.post(f"/api/admin/nodes/{first['node_id']}/allow-reenroll").status_code == 200
    client.logout()
    theirs = enroll(client, token_of(owner), name="real", port=50063)
    assert theirs.status_code == 201, theirs.content
    assert theirs.json()["node_id"] != first["node_id"]
    assert Node.objects.get(pk=theirs.json()["node_id"]).account_id == owner.id
    squatted = Node.objects.get(pk=first["node_id"])
    assert squatted.account_id == squatter.id
    # The squatter's node kept its credential: nothing of it was handed over.
    assert beat(client, first["node_id"], first["credential"]) == 200
    assert Node.objects.filter(machine_id="colleagues-machine-id").count() == 2


def test_within_one_account_the_machine_still_gets_its_node_back_only_as_before(
    client: Client,
) -> None:
    acct = AccountFactory()
    first = enroll(client, token_of(acct), name="box", port=50064)
    assert first.status_code == 201
    again = enroll(client, token_of(acct), name="box", port=50064)
    assert again.status_code == 409 and again.json()["error"]["code"] == "machine_enrolled"
    assert Node.objects.count() == 1
