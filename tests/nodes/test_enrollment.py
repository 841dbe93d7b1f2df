from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.nodes.enrollment import enrollment_token_revoke
from apps.nodes.models import EnrollmentToken, Event, Node
from apps.nodes.states import NodeState
from tests.support.enrollment import enroll_body, issue, post

pytestmark = pytest.mark.django_db


def test_enrollment_creates_node_with_structured_hardware_and_event(client: Client) -> None:
    resp = post(client, enroll_body(issue()))
    assert resp.status_code == 201, resp.content
    data = resp.json()
    node = Node.objects.get(pk=data["node_id"])
    assert node.state == NodeState.REGISTERING
    assert node.vram_total == 12 * 1024**3 and node.gpu_count == 1
    assert node.cpu_logical_cores == 8 and node.gflops == 50.0
    assert data["credential"] and data["credential"] not in node.credential_hash
    assert Event.objects.filter(node=node, kind="NODE_ENROLLED").count() == 1


def test_token_is_stored_only_hashed() -> None:
    plaintext = issue()
    tok = EnrollmentToken.objects.get()
    assert plaintext not in (tok.token_hash, tok.prefix)
    assert tok.prefix == plaintext[:10]


def test_same_machine_enrolling_again_gets_the_same_node(client: Client) -> None:
    token = issue(max_uses=1)
    first = post(client, enroll_body(token)).json()
    # Re-enrolling an enrolled machine presents its node's current credential (issue 12).
    second = client.post(
        "/api/agent/enroll",
        enroll_body(token, node_name="box-renamed"),
        content_type="application/json",
        headers={"Authorization": f"Node {first['node_id']}:{first['credential']}"},
    )
    assert second.status_code == 200
    assert second.json()["node_id"] == first["node_id"]
    assert Node.objects.count() == 1
    assert Node.objects.get().name == "box-renamed"
    assert second.json()["credential"] != first["credential"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("invalid", "invalid enrollment token"),
        ("expired", "expired"),
        ("used", "used up"),
        ("revoked", "revoked"),
    ],
)
def test_refused_token_gets_401_naming_why_and_creates_nothing(
    client: Client, setup: str, message: str
) -> None:
    token = issue(max_uses=1)
    tok = EnrollmentToken.objects.get()
    if setup == "invalid":
        token = token + "x"
    elif setup == "expired":
        EnrollmentToken.objects.filter(pk=tok.pk).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
    elif setup == "used":
        post(client, enroll_body(token, machine_id="other-machine"))
    elif setup == "revoked":
        enrollment_token_revoke(token_id=tok.pk, now=timezone.now())
    before = Node.objects.count()
    resp = post(client, enroll_body(token))
    assert resp.status_code == 401
    assert message in resp.json()["error"]["message"]
    assert Node.objects.count() == before


def test_rotating_the_secret_invalidates_outstanding_tokens(client: Client, settings: Any) -> None:
    token = issue()
    settings.NODE_ENROLLMENT_SECRET = "a-new-secret"
    resp = post(client, enroll_body(token))
    assert resp.status_code == 401
    assert Node.objects.count() == 0


def test_malformed_body_gets_400_with_field_errors(client: Client) -> None:
    body = enroll_body(issue(), rpc_port=70000, node_name="bad name!")
    del body["hardware"]["cpu"]["model"]
    resp = post(client, body)
    assert resp.status_code == 400
    fields = resp.json()["error"]["fields"]
    assert {"rpc_port", "node_name", "hardware"} <= set(fields)
    assert Node.objects.count() == 0


def test_non_json_body_gets_400(client: Client) -> None:
    resp = client.post("/api/agent/enroll", "{not json", content_type="application/json")
    assert resp.status_code == 400


def test_public_advertise_address_is_a_security_violation(client: Client) -> None:
    resp = post(client, enroll_body(issue(), advertise_address="8.8.8.8"))
    assert resp.status_code == 401
    assert "Public IP security violation" in resp.json()["error"]["message"]
    assert Event.objects.filter(kind="PUBLIC_IP_VIOLATION").exists()
    assert Node.objects.count() == 0
