"""The controller's half of signed commands and of the LAN trust rules: the key a node gets at
enrollment (or in one heartbeat), commands signed under it, refusals recorded as security events,
probe keys for peers, per-deployment tunnel certificates, and the advertise-address rule."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from django.test import Client
from django.utils import timezone

from agent.protocol import (
    PROTOCOL_VERSION,
    command_signature,
    node_queue_key,
    probe_key,
)
from agent.tunnel import TunnelTls
from apps.jobs.placement import tunnel_certificate
from apps.nodes.commands import command_result_accept, command_send
from apps.nodes.enrollment import enrollment_token_issue
from apps.nodes.links import links_probe_request
from apps.nodes.models import Event, EventCategory, Node
from racon.ids import DeploymentId
from racon.redis import get_redis
from tests.factories import AccountFactory, hardware_profile

pytestmark = pytest.mark.django_db

_MACHINES = itertools.count(1)


def enroll(
    client: Client,
    *,
    advertise: str = "10.0.0.5",
    source: str = "127.0.0.1",
    presented: tuple[str, str] | None = None,
    machine: str | None = None,
) -> Any:
    account: Any = AccountFactory()
    _, token = enrollment_token_issue(account_id=account.id, label="t", now=timezone.now())
    n = next(_MACHINES)
    body = {
        "token": token, "node_name": f"box-{n}", "machine_id": machine or f"machine-{n}",
        "agent_version": "0.1.0", "protocol_version": PROTOCOL_VERSION,
        "advertise_address": advertise, "rpc_port": 50000 + n, "hardware": hardware_profile(),
    }  # fmt: skip
    headers = {"Authorization": f"Node {presented[0]}:{presented[1]}"} if presented else {}
    return client.post(
        "/api/agent/enroll",
        body,
        content_type="application/json",
        REMOTE_ADDR=source,
        headers=headers,
    )


def queued(node_id: str) -> list[dict[str, Any]]:
    r = get_redis()
    items = [json.loads(raw) for raw in r.lrange(node_queue_key(node_id), 0, -1)]
    r.delete(node_queue_key(node_id))
    return items


def verifies(command: dict[str, Any], key_hex: str) -> bool:
    want = command_signature(
        bytes.fromhex(key_hex), node_id=command["node_id"], command_id=command["id"],
        kind=command["kind"], payload=command["payload"], issued_at=command["issued_at"],
    )  # fmt: skip
    return want == command["sig"]


def test_commands_are_signed_with_the_key_the_node_got_at_enrollment(client: Client) -> None:
    resp = enroll(client)
    assert resp.status_code == 201, resp.content
    node_id, cred, key = (resp.json()[k] for k in ("node_id", "credential", "command_key"))
    assert len(bytes.fromhex(key)) == 32
    # What the agent reads back is what was signed: floats, non-ASCII, int keys, tuples.
    payload = {"x": [1.5, "é", 1e-7], "slots": {10: "a", 2: (1, 2)}}
    command_send(node_id=node_id, kind="rescan_models", payload=payload)
    (cmd,) = queued(node_id)
    assert cmd["node_id"] == node_id and verifies(cmd, key)
    # Another node's key does not verify it.
    other = enroll(client).json()
    assert not verifies(cmd, other["command_key"])
    # An agent enrolled before signing asks in a heartbeat, with its credential, and gets it.
    beat = client.post(
        "/api/agent/heartbeat",
        {"telemetry": {}, "protocol_version": PROTOCOL_VERSION, "want_command_key": True},
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    )
    assert beat.status_code == 200 and beat.json()["command_key"] == key
    plain = client.post(
        "/api/agent/heartbeat",
        {"telemetry": {}, "protocol_version": PROTOCOL_VERSION},
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    )
    assert "command_key" not in plain.json()


def test_a_re_enrollment_gives_a_new_key_and_commands_follow_it(client: Client) -> None:
    first = enroll(client, machine="machine-re").json()
    again = enroll(client, machine="machine-re", presented=(first["node_id"], first["credential"]))
    assert again.status_code == 200, again.content
    second = again.json()
    assert second["node_id"] == first["node_id"]
    assert second["command_key"] != first["command_key"]
    command_send(node_id=first["node_id"], kind="rescan_models", payload={})
    (cmd,) = queued(first["node_id"])
    assert verifies(cmd, second["command_key"]) and not verifies(cmd, first["command_key"])


def test_a_nodes_refusal_of_a_command_is_a_security_event(client: Client) -> None:
    node_id = enroll(client).json()["node_id"]
    cid = command_send(node_id=node_id, kind="rescan_models", payload={})
    queued(node_id)
    command_result_accept(
        node_id=node_id,
        command_id=cid,
        payload={"ok": False, "code": "command_replayed", "error": "refused command: a replay"},
        now=timezone.now(),
    )
    event = Event.objects.get(kind="COMMAND_REFUSED")
    assert event.category == EventCategory.SECURITY and str(event.node_id) == node_id
    assert event.data == {"command_id": cid, "code": "command_replayed"}


def test_a_probe_request_carries_each_peers_probe_key(client: Client) -> None:
    a = enroll(client).json()
    b = enroll(client).json()
    Node.objects.filter(pk__in=[a["node_id"], b["node_id"]]).update(state="READY")
    assert links_probe_request(node_id=a["node_id"]) is not None
    (cmd,) = queued(a["node_id"])
    (peer,) = cmd["payload"]["peers"]
    assert peer["node_id"] == b["node_id"]
    assert peer["probe_key"] == probe_key(bytes.fromhex(b["command_key"])).hex()


def test_each_deployment_gets_its_own_tunnel_certificate_from_the_ca(
    settings: Any, tmp_path: Path
) -> None:
    settings.VAR_DIR = tmp_path
    one = TunnelTls.from_wire(tunnel_certificate(deployment_id=DeploymentId("dep-1")))
    two = TunnelTls.from_wire(tunnel_certificate(deployment_id=DeploymentId("dep-2")))
    assert one.ca == two.ca and one.fingerprint != two.fingerprint
    assert "racon-tunnel dep-1" in _subject(one.cert)
    assert oct((tmp_path / "tls" / "ca.key").stat().st_mode & 0o777) == "0o600"


def _subject(pem: str) -> str:
    return x509.load_pem_x509_certificate(pem.encode()).subject.rfc4514_string()


@pytest.mark.parametrize(
    ("advertise", "source", "refused"),
    [
        ("10.0.0.7", "10.0.0.7", None),  # another machine, advertising where it came from
        ("10.0.0.5", "127.0.0.1", None),  # the controller's own machine: any private address
        ("127.0.0.1", "127.0.0.1", None),
        ("10.0.0.5", "10.0.0.7", "not the address this enrollment came from (10.0.0.7)"),
        ("127.0.0.1", "10.0.0.7", "is loopback"),
        ("169.254.3.4", "10.0.0.7", "is link-local"),
    ],
)
def test_a_remote_node_must_advertise_the_address_it_enrolled_from(
    client: Client, advertise: str, source: str, refused: str | None
) -> None:
    resp = enroll(client, advertise=advertise, source=source)
    if refused is None:
        assert resp.status_code == 201, resp.content
        return
    assert resp.status_code == 401, resp.content
    message = resp.json()["error"]["message"]
    assert refused in message and f"--advertise-address {source}" in message
    assert Node.objects.count() == 0
