"""A node's diagnostics bundle: its contents, its summary, and that no secret ever gets into it."""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command, execute_from_command_line
from django.core.management.base import CommandError

from agent.protocol import HEARTBEATS_ZSET, heartbeat_key, node_queue_key
from apps.api.auth import api_key_create
from apps.jobs.diagnostics import (
    REDACTED,
    is_secret_name,
    node_diagnostics_bundle,
    rpc_probe,
    scrub,
)
from apps.models_repo.models import ModelFile
from apps.nodes.enrollment import enrollment_token_issue, node_enroll
from apps.nodes.events import event_record
from apps.nodes.models import EnrollmentToken, EventCategory, Node
from apps.nodes.services import node_report_fault
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis
from tests.factories import AccountFactory, NodeFactory, hardware_profile
from tests.support.observability import make_deployment, make_job, unpack

pytestmark = pytest.mark.django_db

PLANTED = {
    "SECRET_KEY": "planted-django-secret-key-" + "s" * 30,
    "NODE_ENROLLMENT_SECRET": "planted-enrollment-secret-" + "e" * 20,
    "AI_API_KEY": "planted-ai-api-key-" + "a" * 20,
    "METRICS_TOKEN": "planted-metrics-token-" + "m" * 20,
    "RACON_RECEIPT_KEY": "cmVjZWlwdC1rZXktcGxhbnRlZC1mb3ItdGhlLXRlc3Q=",  # base64 of 32 bytes
}
HW_PASSWORD = "planted-hardware-password-123456"
TELEMETRY_TOKEN = "planted-telemetry-token-abcdef"
REDIS_PASSWORD = "planted-redis-pw-hunter2"


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port that accepts connections, standing in for a node's ggml-rpc worker."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield int(s.getsockname()[1])
    s.close()


@pytest.fixture
def sick_node(settings: Any, model_file: ModelFile, now: Any, listener: int) -> dict[str, Any]:
    """A node enrolled for real, with secrets planted everywhere a careless bundle would leak them."""
    for name, value in PLANTED.items():
        setattr(settings, name, value)
    account = AccountFactory()
    _, token = enrollment_token_issue(account_id=ids.account_id(account.id), label="diag", now=now)
    hw = hardware_profile()
    hw["extra"] = {"password": HW_PASSWORD, "notes": f"set up with {token}"}
    enrolled = node_enroll(
        token=token,
        node_name="sick-box",
        machine_id="machine-sick",
        hardware=hw,
        address="127.0.0.1",
        rpc_port=listener,
        agent_version="0.1.0",
        now=now - timedelta(minutes=10),
    )
    node = enrolled.node
    _, api_key = api_key_create(
        name="k", account_id=ids.account_id(account.id), scopes=["inference"]
    )
    node_report_fault(
        node_id=ids.node_id(node.id),
        fatal=False,
        message=f"llama.cpp crashed; last request used key {api_key}",
        now=now - timedelta(minutes=5),
    )
    event_record(
        kind="COMMAND_FAILED",
        category=EventCategory.RUNTIME,
        now=now - timedelta(minutes=4),
        node_id=ids.node_id(node.id),
        message="load_primary failed",
        data={"redis_url": f"redis://:{REDIS_PASSWORD}@10.0.0.9:6379/0", "secret": "x" * 20},
    )
    dep = make_deployment(model_file, primary=node, nodes=[node])
    during = make_job(
        model_file,
        state="FAILED",
        now=now - timedelta(minutes=3),
        deployment=dep,
        nodes=[node],
        failed_during_execution=True,
        error=(
            "the primary node of this deployment stopped responding "
            f"({PLANTED['AI_API_KEY']} {PLANTED['RACON_RECEIPT_KEY']})"
        ),
        placement={"primary": str(node.id), "devices": []},
    )
    before = make_job(
        model_file,
        state="FAILED",
        now=now - timedelta(minutes=2),
        deployment=dep,
        nodes=[node],
        failed_during_execution=False,
        error="no capacity: queue full",
    )
    ok = make_job(
        model_file,
        state="COMPLETED",
        now=now - timedelta(minutes=1),
        deployment=dep,
        nodes=[node],
        completion_tokens=12,
        placement={"primary": str(node.id)},
    )
    r = get_redis()
    r.zadd(HEARTBEATS_ZSET, {str(node.id): now.timestamp() - 3})
    r.hset(
        heartbeat_key(str(node.id)),
        mapping={
            "telemetry": json.dumps(
                {"agent_version": "0.1.1", "auth_token": TELEMETRY_TOKEN, "mem_available": 1}
            )
        },
    )
    r.rpush(node_queue_key(str(node.id)), "{}", "{}")
    return {
        "node": node,
        "credential": enrolled.credential,
        "token": token,
        "api_key": api_key,
        "jobs": {"during": str(during.id), "before": str(before.id), "ok": str(ok.id)},
        "deployment": dep,
    }


def test_the_bundle_holds_versions_state_events_hardware_errors_jobs_and_reachability(
    sick_node: dict[str, Any], now: Any
) -> None:
    node: Node = sick_node["node"]
    files = unpack(node_diagnostics_bundle(node_id=ids.node_id(node.id), now=now))
    assert set(files) == {
        "summary.txt",
        "versions.json",
        "node.json",
        "state_history.json",
        "events.json",
        "hardware.json",
        "errors.json",
        "jobs.json",
        "deployments.json",
        "reachability.json",
    }
    versions = json.loads(files["versions.json"])
    assert (
        versions["agent_version"] == "0.1.0" and versions["agent_version_reported_live"] == "0.1.1"
    )
    assert versions["controller_version"]
    assert json.loads(files["node.json"])["state"] == "DEGRADED"
    history = json.loads(files["state_history.json"])
    assert [(h["from"], h["to"]) for h in history] == [
        ("UNINITIALIZED", "REGISTERING"),
        ("REGISTERING", "DEGRADED"),
    ]
    kinds = [e["kind"] for e in json.loads(files["events.json"])]
    assert {"NODE_ENROLLED", "NODE_FAULT", "COMMAND_FAILED"} <= set(kinds)
    assert json.loads(files["hardware.json"])["inventory"]["cpu"]["logical_cores"] == 8

    jobs = {j["id"]: j for j in json.loads(files["jobs.json"])}
    job_ids = sick_node["jobs"]
    assert (
        jobs[job_ids["during"]]["failure_phase"] == "during execution"
        and jobs[job_ids["during"]]["primary"] is True
    )
    assert jobs[job_ids["before"]]["failure_phase"] == "before execution"
    assert jobs[job_ids["ok"]]["failure_phase"] is None and jobs[job_ids["ok"]]["failed"] is False

    errors = json.loads(files["errors.json"])
    assert {e["kind"] for e in errors["events"]} >= {"NODE_FAULT", "COMMAND_FAILED"}
    assert {j["id"] for j in errors["jobs"]} == {job_ids["during"], job_ids["before"]}

    reach = json.loads(files["reachability.json"])
    assert 2.5 <= reach["heartbeat_age_seconds"] <= 4
    assert reach["redis_queue_depth"] == 2
    assert reach["rpc_probe"]["ok"] is True

    summary = files["summary.txt"].decode()
    assert "sick-box" in summary and "state: DEGRADED" in summary
    assert "failed 2 (before execution 1, during execution 1, unknown 0)" in summary
    assert "NODE_FAULT" in summary and "rpc port 127.0.0.1:" in summary and "reachable" in summary


def test_no_secret_appears_anywhere_in_the_bundle(sick_node: dict[str, Any], now: Any) -> None:
    node: Node = sick_node["node"]
    data = node_diagnostics_bundle(node_id=ids.node_id(node.id), now=now)
    files = unpack(data)
    everything = b"\n".join(files.values())
    token_hash = EnrollmentToken.objects.get().token_hash
    forbidden = [
        *PLANTED.values(),
        HW_PASSWORD,
        TELEMETRY_TOKEN,
        REDIS_PASSWORD,
        sick_node["credential"],
        sick_node["token"],
        sick_node["api_key"],
        node.credential_hash,
        token_hash,
    ]
    for secret in forbidden:
        assert secret.encode() not in everything, f"{secret[:12]}… leaked into the bundle"
        assert secret.encode() not in data
    # The scrubbing is visible, and it left the harmless fields alone.
    assert REDACTED.encode() in files["hardware.json"] and REDACTED.encode() in files["errors.json"]
    assert json.loads(files["jobs.json"])[0]["completion_tokens"] == 12


def test_an_unreachable_rpc_port_is_reported(now: Any) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()  # bound then closed: nothing listens there
    probe = rpc_probe(host="127.0.0.1", port=port, timeout=0.5)
    assert probe["ok"] is False and "Refused" in probe["error"]
    node = NodeFactory(address="127.0.0.1", rpc_port=port, state="OFFLINE")
    files = unpack(node_diagnostics_bundle(node_id=ids.node_id(node.id), now=now))
    assert "UNREACHABLE" in files["summary.txt"].decode()
    assert "never seen" in files["summary.txt"].decode()
    assert json.loads(files["reachability.json"])["heartbeat_late"] is True


def test_secret_names_are_recognised_but_token_counts_are_kept() -> None:
    for name in (
        "token",
        "enrollment_token",
        "credential_hash",
        "api_key",
        "SECRET_KEY",
        "password",
        "key",
        "signing_key",
    ):
        assert is_secret_name(name), name
    for name in (
        "prompt_tokens",
        "completion_tokens",
        "tokens_per_s",
        "max_tokens",
        "key_id",
        "kind",
    ):
        assert not is_secret_name(name), name
    assert scrub({"a": ["rk_" + "x" * 20, "http://u:pw@h/"]}, []) == {
        "a": [REDACTED, f"http://u:{REDACTED}@h/"]
    }


# --- the management command ----------------------------------------------------------------------


def test_diagnose_by_name_writes_the_bundle_and_prints_a_summary(
    sick_node: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "sub" / "bundle.tar.gz"
    call_command("racon_diagnose", "sick-box", "--out", str(out))
    printed = capsys.readouterr().out
    assert "RACoN node diagnostics: sick-box" in printed and f"bundle written to {out}" in printed
    assert "summary.txt" in unpack(out.read_bytes())
    assert out.stat().st_mode & 0o077 == 0


def test_diagnose_by_id_and_by_id_prefix(sick_node: dict[str, Any], tmp_path: Path) -> None:
    node: Node = sick_node["node"]
    for ref in (str(node.id), str(node.id)[:8]):
        out = tmp_path / f"{ref}.tar.gz"
        call_command("racon_diagnose", ref, "--out", str(out), stdout=io.StringIO())
        assert json.loads(unpack(out.read_bytes())["node.json"])["id"] == str(node.id)


def test_diagnose_an_unknown_node_is_a_clear_error_and_a_nonzero_exit(
    db: None, capsys: Any
) -> None:
    with pytest.raises(CommandError, match="no node named or with id 'ghost'"):
        call_command("racon_diagnose", "ghost")
    with pytest.raises(SystemExit) as exit_info:
        execute_from_command_line(["manage.py", "racon_diagnose", "ghost"])
    assert exit_info.value.code == 1
    assert "no node named or with id 'ghost'" in capsys.readouterr().err


def test_diagnose_refuses_an_ambiguous_name(db: None) -> None:
    a, b = NodeFactory(name="twin"), NodeFactory(name="twin")
    with pytest.raises(CommandError, match="2 nodes are named 'twin'") as err:
        call_command("racon_diagnose", "twin")
    assert str(a.id) in str(err.value) and str(b.id) in str(err.value)


# --- the admin API -------------------------------------------------------------------------------


@pytest.mark.urls("tests.observability.urls")
def test_the_admin_api_serves_the_bundle_to_staff_only(
    sick_node: dict[str, Any], client: Any, settings: Any
) -> None:
    node: Node = sick_node["node"]
    url = f"/api/admin/nodes/{node.id}/diagnostics"
    assert client.get(url).status_code in (401, 403)
    user_key = sick_node["api_key"]
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {user_key}").status_code == 403
    resp = client.get(url, HTTP_AUTHORIZATION=f"Bearer {settings.AI_API_KEY}")
    assert resp.status_code == 200
    assert resp["Content-Type"] == "application/gzip"
    assert "attachment" in resp["Content-Disposition"]
    assert "summary.txt" in unpack(resp.content)
    missing = client.get(
        "/api/admin/nodes/00000000-0000-0000-0000-000000000000/diagnostics",
        HTTP_AUTHORIZATION=f"Bearer {settings.AI_API_KEY}",
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


def test_a_malformed_node_id_is_an_unknown_node(db: None, now: Any) -> None:
    from apps.jobs.diagnostics import UnknownNode

    with pytest.raises(UnknownNode):
        node_diagnostics_bundle(node_id=NodeId("not-a-uuid"), now=now)
