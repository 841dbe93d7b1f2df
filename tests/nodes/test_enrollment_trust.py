"""Enrollment and capacity claims a hostile contributor could abuse (issue 12): each test performs
the attack and asserts the refusal, its reason, and that nothing stored changed."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from agent.protocol import PROTOCOL_VERSION, heartbeat_key
from apps.nodes.models import Event, Node
from tests.factories import AccountFactory
from tests.support.enrollment import enroll_body, issue, post

pytestmark = pytest.mark.django_db
GIB = 1024**3


def heartbeat(client: Client, node_id: str, cred: str, telemetry: Any, state: str = "READY") -> Any:
    return client.post(
        "/api/agent/heartbeat",
        {"state": state, "telemetry": telemetry, "protocol_version": PROTOCOL_VERSION},
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    )


# --- re-enrollment --------------------------------------------------------------------------------


def test_a_second_token_cannot_take_over_an_enrolled_machine_and_the_real_agent_keeps_working(
    client: Client,
) -> None:
    # Within the account: another account's token makes a node of that account's own instead
    # (machine_id is unique per account: tests/nodes/test_machine_per_account.py).
    acct = AccountFactory()
    real = post(client, enroll_body(issue(account=acct))).json()
    before = Node.objects.get(pk=real["node_id"])
    resp = post(client, enroll_body(issue(account=acct), node_name="hijack"))
    assert resp.status_code == 409, resp.content
    error = resp.json()["error"]
    assert error["code"] == "machine_enrolled"
    assert "machine-aaa" in error["message"] and "current credential" in error["message"]
    after = Node.objects.get(pk=real["node_id"])
    assert (after.name, after.credential_hash, after.account_id) == (
        before.name,
        before.credential_hash,
        before.account_id,
    )
    assert Node.objects.count() == 1
    assert heartbeat(client, real["node_id"], real["credential"], {}).status_code == 200


def test_re_enrolling_with_a_wrong_credential_is_refused(client: Client) -> None:
    acct = AccountFactory()
    real = post(client, enroll_body(issue(account=acct))).json()
    resp = client.post(
        "/api/agent/enroll",
        enroll_body(issue(account=acct)),
        content_type="application/json",
        headers={"Authorization": f"Node {real['node_id']}:rnc_guess"},
    )
    assert resp.status_code == 409 and "not its current one" in resp.json()["error"]["message"]
    assert heartbeat(client, real["node_id"], real["credential"], {}).status_code == 200


def test_an_operator_can_allow_one_re_enrollment_without_the_credential(client: Client) -> None:
    acct = AccountFactory()
    real = post(client, enroll_body(issue(account=acct))).json()
    admin = get_user_model().objects.create_user("op", password="pw-test-123", is_staff=True)
    client.force_login(admin)
    resp = client.post(f"/api/admin/nodes/{real['node_id']}/allow-reenroll")
    assert resp.status_code == 200, resp.content
    assert resp.json()["window_seconds"] == 3600
    assert Event.objects.filter(kind="NODE_REENROLL_ALLOWED", node_id=real["node_id"]).exists()
    client.logout()
    again = post(client, enroll_body(issue(account=acct)))
    assert again.status_code == 200 and again.json()["node_id"] == real["node_id"]
    # The old credential stopped working; the permission was used up.
    assert heartbeat(client, real["node_id"], real["credential"], {}).status_code == 401
    assert post(client, enroll_body(issue(account=acct))).status_code == 409


def test_node_names_are_unique_within_an_account(client: Client) -> None:
    acct = AccountFactory()
    token = issue(account=acct, max_uses=5)
    assert post(client, enroll_body(token)).status_code == 201
    resp = post(client, enroll_body(token, machine_id="machine-bbb", rpc_port=50053))
    assert resp.status_code == 409
    assert (
        resp.json()["error"]["code"] == "node_name_taken"
        and "'box-1'" in resp.json()["error"]["message"]
    )
    assert Node.objects.count() == 1
    # Another account may use the name.
    assert (
        post(client, enroll_body(issue(), machine_id="machine-ccc", rpc_port=50054)).status_code
        == 201
    )


def test_the_public_ip_event_is_recorded_only_once_the_token_is_valid(client: Client) -> None:
    resp = post(client, enroll_body("rcn_not-a-token", advertise_address="8.8.8.8"))
    assert resp.status_code == 401 and "invalid enrollment token" in resp.json()["error"]["message"]
    assert not Event.objects.filter(kind="PUBLIC_IP_VIOLATION").exists()
    resp = post(client, enroll_body(issue(), advertise_address="8.8.8.8"))
    assert (
        resp.status_code == 401
        and "Public IP security violation" in resp.json()["error"]["message"]
    )
    assert Event.objects.filter(kind="PUBLIC_IP_VIOLATION").count() == 1


# --- capacity bounds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "field", "setting"),
    [
        (("memory", "total"), 9 * 10**18, "memory.total", "NODE_MAX_MEMORY_BYTES"),
        (("memory", "available"), 9 * 10**18, "memory.available", "NODE_MAX_MEMORY_BYTES"),
        (("cpu", "logical_cores"), 1_000_000, "cpu.logical_cores", "NODE_MAX_CORES"),
        (("benchmark", "gflops"), 1e12, "benchmark.gflops", "NODE_MAX_GFLOPS"),
        (
            ("benchmark", "mem_bandwidth_gbps"),
            1e9,
            "benchmark.mem_bandwidth_gbps",
            "NODE_MAX_BANDWIDTH_GBPS",
        ),
        (("gpus", 0, "vram_total"), 5 * 1024**4, "gpus[0].vram_total", "NODE_MAX_VRAM_BYTES"),
    ],
)
def test_an_implausible_capacity_claim_at_enrollment_is_refused_naming_the_field_and_bound(
    client: Client, path: tuple[Any, ...], value: Any, field: str, setting: str
) -> None:
    body = enroll_body(issue())
    target = body["hardware"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    if field == "gpus[0].vram_total":
        target["vram_free"] = 0
    resp = post(client, body)
    assert resp.status_code == 400, resp.content
    messages = [m for ms in resp.json()["error"]["fields"]["hardware"].values() for m in ms]
    assert any(field in m and setting in m and "plausible bound" in m for m in messages), messages
    assert Node.objects.count() == 0


def test_free_memory_over_the_total_is_refused(client: Client) -> None:
    body = enroll_body(issue())
    body["hardware"]["memory"] = {"total": 8 * GIB, "available": 64 * GIB}
    resp = post(client, body)
    assert resp.status_code == 400
    assert "memory.available" in str(resp.json()["error"]["fields"])


def test_heartbeat_memory_over_the_bound_is_clamped_and_recorded_once(
    client: Client, settings: Any
) -> None:
    from racon.redis import get_redis

    enrolled = post(client, enroll_body(issue())).json()
    node_id, cred = enrolled["node_id"], enrolled["credential"]
    for _ in range(3):
        resp = heartbeat(
            client, node_id, cred, {"mem_available": 9 * 10**18, "gpu_free": [9 * 10**18]}
        )
        assert resp.status_code == 200, resp.content
    stored = get_redis().hgetall(heartbeat_key(node_id))
    assert int(stored["mem_available"]) == settings.NODE_MAX_MEMORY_BYTES
    assert stored["gpu_free"] == str(settings.NODE_MAX_VRAM_BYTES)
    node = Node.objects.get(pk=node_id)
    assert (
        node.ram_available == node.ram_total == 16 * GIB
    )  # the transition to READY wrote a bounded figure
    assert Event.objects.filter(kind="TELEMETRY_CLAMPED", node_id=node_id).count() == 1


@pytest.mark.parametrize(
    "telemetry",
    [
        {"cpu_percent": "lots"},
        {"mem_available": -1},
        {"mem_available": [1]},
        {"gpu_free": "x"},
        {"gpu_free": ["x"]},
        {"jobs": 3},
        {"rpc_worker": "yes"},
        "not-an-object",
    ],
)
def test_malformed_telemetry_gets_400_naming_the_field_not_500(
    client: Client, telemetry: Any
) -> None:
    enrolled = post(client, enroll_body(issue())).json()
    resp = heartbeat(client, enrolled["node_id"], enrolled["credential"], telemetry)
    assert resp.status_code == 400, resp.content
    assert "telemetry" in resp.json()["error"]["message"]


@pytest.mark.parametrize("header", ["Node not-a-uuid:x", "Node ../../etc:x", "Node :x"])
def test_heartbeat_with_a_malformed_node_id_gets_401_not_500(client: Client, header: str) -> None:
    resp = client.post(
        "/api/agent/heartbeat",
        {"telemetry": {}, "protocol_version": PROTOCOL_VERSION},
        content_type="application/json",
        headers={"Authorization": header},
    )
    assert resp.status_code == 401, resp.content
    assert "node id" in resp.json()["error"]["message"]
