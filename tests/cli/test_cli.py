"""The real `racon` CLI against a live controller: tables, --json, and one-line error exits."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from apps.accounts.models import ApiKey
from apps.api.auth import api_key_create
from apps.credits.ledger import account_for_user
from apps.credits.models import Receipt
from apps.credits.settlement import credit_reserve, credit_settle_job
from apps.jobs.models import Job
from apps.jobs.states import JobState
from apps.nodes.links import link_record
from apps.nodes.models import Node
from apps.nodes.states import NodeState
from racon import ids
from racon_cli.client import EXIT_API, EXIT_CONFIG, EXIT_UNREACHABLE
from tests.e2e.harness import Controller, smollm2_path
from tests.factories import (
    ModelFactory,
    NodeFactory,
    UserFactory,
    deployment_for,
    job_finish,
    job_for,
)
from tests.support.cli import Run, one_error_line

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def two_nodes(transactional_db: None) -> tuple[Node, Node]:
    return NodeFactory(name="alpha", cpu_logical_cores=12), NodeFactory(name="beta")


# --- nodes -------------------------------------------------------------------------------------


def test_nodes_ls_prints_a_table_and_json(racon: Run, two_nodes: tuple[Node, Node]) -> None:
    res = racon("nodes", "ls")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "ID", "STATE"]
    alpha = next(ln for ln in lines if ln.startswith("alpha"))
    assert "READY" in alpha and "12" in alpha and str(two_nodes[0].id)[:8] in alpha
    res = racon("nodes", "ls", "--json")
    data = json.loads(res.stdout)
    assert {n["name"] for n in data} == {"alpha", "beta"} and all(
        n["state"] == "READY" for n in data
    )
    res = racon("nodes", "ls", "--state", "offline", "--json")
    assert json.loads(res.stdout) == []


def test_nodes_show_by_name_or_id(racon: Run, two_nodes: tuple[Node, Node]) -> None:
    res = racon("nodes", "show", "alpha")
    assert res.exit_code == 0 and "Test CPU" in res.stdout and "READY" in res.stdout
    res = racon("nodes", "show", str(two_nodes[1].id), "--json")
    data = json.loads(res.stdout)
    assert (
        data["name"] == "beta"
        and data["hardware"]["cpu"]["model"] == "Test CPU"
        and "telemetry" in data
    )


def test_drain_and_undrain_by_name(racon: Run, two_nodes: tuple[Node, Node]) -> None:
    res = racon("nodes", "drain", "alpha")
    assert (
        res.exit_code == 0
        and "drained alpha: DRAINED (drained: current work has ended)" in res.stdout
    )
    assert Node.objects.get(name="alpha").state == NodeState.DRAINED
    res = racon("nodes", "undrain", "alpha", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["state"] == "READY"


def test_an_unknown_node_is_one_404_line(racon: Run, two_nodes: tuple[Node, Node]) -> None:
    for args in (
        ("nodes", "show", "ghost"),
        ("nodes", "drain", "ghost"),
        ("nodes", "show", "00000000-0000-0000-0000-000000000000"),
    ):
        res = racon(*args)
        assert res.exit_code == EXIT_API
        assert "404" in one_error_line(res)
    assert "no node named 'ghost'" in racon("nodes", "drain", "ghost").stderr


# --- errors --------------------------------------------------------------------------------------


def test_an_unreachable_controller_is_one_line_and_exit_3(racon: Run) -> None:
    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        res = racon("nodes", "ls", url=f"http://127.0.0.1:{held.getsockname()[1]}")
    assert res.exit_code == EXIT_UNREACHABLE
    assert "cannot reach the controller" in one_error_line(res)


def test_a_wrong_key_is_one_401_line(racon: Run) -> None:
    res = racon("nodes", "ls", key="rk_wrong")
    assert res.exit_code == EXIT_API
    line = one_error_line(res)
    assert "401" in line and "invalid API key" in line


def test_a_key_without_admin_rights_is_one_403_line(racon: Run, transactional_db: None) -> None:
    user = UserFactory(username="dora")
    _, plaintext = api_key_create(
        name="dora",
        account_id=ids.account_id(account_for_user(user=user).id),
        scopes=[ApiKey.SCOPE_INFERENCE],
        user_id=user.pk,
    )
    res = racon("nodes", "ls", key=plaintext)
    assert res.exit_code == EXIT_API and "403" in one_error_line(res)
    res = racon("credits", "balance", key=plaintext)  # but it may read its own balance
    assert res.exit_code == 0 and "user:dora" in res.stdout


def test_no_configuration_says_how_to_log_in(racon: Run) -> None:
    res = racon("nodes", "ls", key="")
    assert res.exit_code == EXIT_CONFIG and "racon login" in one_error_line(res)


def test_login_saves_url_and_key_readable_by_the_owner_only(
    racon: Run, live: Controller, tmp_path: Path
) -> None:
    bad = racon("login", "--url", live.url, "--key", "rk_wrong")
    assert bad.exit_code == EXIT_API and "401" in one_error_line(bad)
    assert not (tmp_path / "config.json").exists()
    res = racon("login", "--url", live.url, "--key", live.api_key)
    assert res.exit_code == 0, res.output
    path = tmp_path / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"url": live.url, "key": live.api_key}


# --- tokens ---------------------------------------------------------------------------------------


def test_tokens_create_prints_the_command_once_then_ls_and_revoke(
    racon: Run, transactional_db: None
) -> None:
    res = racon("tokens", "create", "lab-box", "--ttl-hours", "2")
    assert res.exit_code == 0, res.output
    command = res.stdout.strip().splitlines()[-1]
    # The token travels in the environment, never in argv (issue 24).
    assert (
        command.startswith("RACON_ENROLLMENT_TOKEN=rcn_")
        and " node-agent --foreground --controller-url " in command
        and "--enrollment-token" not in command
    )
    secret = command.split("RACON_ENROLLMENT_TOKEN=")[1].split()[0]
    listing = racon("tokens", "ls")
    assert (
        "lab-box" in listing.stdout and "active" in listing.stdout and secret not in listing.stdout
    )
    tokens = json.loads(racon("tokens", "ls", "--json").stdout)
    assert len(tokens) == 1 and "token" not in tokens[0]
    res = racon("tokens", "revoke", tokens[0]["id"][:6])
    assert res.exit_code == 0 and "Revoked token 'lab-box'" in res.stdout
    assert json.loads(racon("tokens", "ls", "--json").stdout)[0]["status"] == "revoked"
    assert racon("tokens", "revoke", "ffffff").exit_code == EXIT_API


# --- models, deploy preview ----------------------------------------------------------------------


def test_models_add_ls_and_deploy_preview(
    racon: Run, two_nodes: tuple[Node, Node], tmp_path: Path
) -> None:
    res = racon("models", "add", str(tmp_path / "missing.gguf"))
    assert res.exit_code == EXIT_API and "no such file" in one_error_line(res)
    res = racon("models", "add", str(smollm2_path()), "--name", "smollm2")
    assert res.exit_code == 0 and "Registered smollm2" in res.stdout and "30 layers" in res.stdout
    assert "smollm2" in racon("models", "ls").stdout
    assert json.loads(racon("models", "ls", "--json").stdout)[0]["files"][0]["n_layer"] == 30

    res = racon(
        "deploy", "smollm2", "--preview", "--nodes", "alpha,beta", "--spread", "--n-ctx", "1024"
    )
    assert res.exit_code == 0, res.output
    assert "Placement of smollm2 — 30 layers" in res.stdout and "tokens/s" in res.stdout
    assert "alpha" in res.stdout and "beta" in res.stdout and "█" in res.stdout
    plan = json.loads(racon("deploy", "smollm2", "--preview", "--json").stdout)
    assert plan["n_layer"] == 30 and plan["predicted_tokens_per_s"] > 0 and plan["explanation"]

    res = racon("deploy", "smollm2", "--preview", "--nodes", "ghost")
    assert res.exit_code == EXIT_API and "404" in one_error_line(res)
    res = racon("deploy", "smollm2", "--preview", "--nodes", "alpha", "--n-ctx", "1048576")
    assert res.exit_code == EXIT_API and "422" in one_error_line(res)
    res = racon("deploy", "nope", "--preview")
    assert res.exit_code == EXIT_API and "unknown model 'nope'" in one_error_line(res)


# --- jobs and credits -----------------------------------------------------------------------------


@pytest.fixture
def settled_job(
    transactional_db: None,
    two_nodes: tuple[Node, Node],
    settings: object,
    tmp_path: Path,
    live: Controller,
) -> Job:
    # Sign with the live controller's key file, so `credits verify` checks against the same key.
    settings.CREDITS_RECEIPT_KEY_PATH = Path(live.env["RACON_VAR_DIR"]) / "receipt-signing.key"  # type: ignore[attr-defined]
    settings.RACON_RECEIPT_KEY = ""  # type: ignore[attr-defined]
    alpha, beta = two_nodes
    user = UserFactory(username="erin")
    acct = account_for_user(user=user)
    dep = deployment_for([(alpha, 20), (beta, 10)], model=ModelFactory(name="tiny"))
    job = job_for(account=acct, model=dep.model, deployment=dep, max_tokens=16)
    job.nodes.set([alpha, beta])
    credit_reserve(
        account_id=ids.account_id(acct.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=16,
        model_price_permille=1000,
        now=timezone.now(),
    )
    job_finish(job, prompt=4, completion=12, device_seconds={str(alpha.pk): 1.0, str(beta.pk): 0.5})
    credit_settle_job(job_id=ids.job_id(job.pk), now=timezone.now())
    return job


def test_jobs_ls_show_and_cancel(racon: Run, settled_job: Job) -> None:
    queued = job_for(account=None, model=settled_job.model, max_tokens=8)
    res = racon("jobs", "ls")
    assert (
        res.exit_code == 0
        and str(settled_job.id)[:8] in res.stdout
        and "COMPLETED" in res.stdout
        and "QUEUED" in res.stdout
    )
    jobs = json.loads(racon("jobs", "ls", "--state", "completed", "--json").stdout)
    assert [j["id"] for j in jobs] == [str(settled_job.id)]
    res = racon("jobs", "show", str(settled_job.id)[:8])
    assert res.exit_code == 0 and "4 prompt → 12 completion" in res.stdout
    res = racon("jobs", "cancel", str(queued.id), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["state"] == "CANCELLED"
    assert Job.objects.get(pk=queued.id).state == JobState.CANCELLED
    assert "404" in one_error_line(racon("jobs", "show", "00000000-0000-0000-0000-000000000000"))


def test_credits_balance_ledger_and_receipt_verify(
    racon: Run, settled_job: Job, tmp_path: Path
) -> None:
    res = racon("credits", "balance")
    assert res.exit_code == 0 and "system:operator" in res.stdout
    balance = json.loads(racon("credits", "balance", "--json").stdout)
    assert balance["account"]["name"] == "system:operator"
    receipt = Receipt.objects.filter(job=settled_job).first()
    assert receipt is not None
    good = tmp_path / "receipt.json"
    good.write_text(json.dumps(receipt.document()))
    res = racon("credits", "verify", str(good))
    assert res.exit_code == 0 and res.stdout.startswith("valid: receipt")
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps({**receipt.document(), "credits": 10**12}))
    res = racon("credits", "verify", str(bad))
    assert res.exit_code == EXIT_API and "does not match" in one_error_line(res)
    assert json.loads(racon("credits", "verify", str(bad), "--json").stdout)["valid"] is False
    res = racon("credits", "verify", str(tmp_path / "none.json"))
    assert res.exit_code == EXIT_CONFIG and "cannot read" in one_error_line(res)
    user_key = api_key_create(
        name="erin",
        account_id=ids.account_id(str(settled_job.account_id)),
        scopes=[ApiKey.SCOPE_INFERENCE],
    )[1]
    ledger = json.loads(racon("credits", "ledger", "--json", key=user_key).stdout)
    assert {p["kind"] for p in ledger["results"]} >= {"GRANT", "RESERVE"}
    assert "starting grant" in racon("credits", "ledger", key=user_key).stdout


# --- diagnose -------------------------------------------------------------------------------------


def test_diagnose_saves_the_bundle_and_summarises_it(
    racon: Run, two_nodes: tuple[Node, Node], tmp_path: Path
) -> None:
    # (A controller without the endpoint is covered in test_cli_offline.py.)
    res = racon("diagnose", "alpha", "-o", str(tmp_path / "alpha.tar.gz"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "alpha.tar.gz").read_bytes()[
        :2
    ] == b"\x1f\x8b" and "Saved diagnostics of alpha" in res.stdout
    summary = json.loads(
        racon(
            "diagnose", str(two_nodes[1].id), "-o", str(tmp_path / "beta.tar.gz"), "--json"
        ).stdout
    )
    assert (
        summary["node"] == "beta"
        and summary["members"]
        and all(m["size"] >= 0 for m in summary["members"])
    )
    assert "404" in one_error_line(racon("diagnose", "ghost"))


# --- the console script (what the CLI imports: test_imports.py) ---------------------------------


def test_the_console_script_runs_as_a_subprocess(live: Controller, tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "racon"
    env = {
        **os.environ,
        "RACON_CONFIG": str(tmp_path / "c.json"),
        "RACON_URL": live.url,
        "RACON_API_KEY": "rk_wrong",
    }
    proc = subprocess.run(
        [str(exe), "nodes", "ls"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (
        proc.returncode == EXIT_API
        and proc.stderr.startswith("error: 401")
        and proc.stderr.count("\n") == 1
    )
    env["RACON_API_KEY"] = live.api_key
    proc = subprocess.run(
        [str(exe), "nodes", "ls", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0 and json.loads(proc.stdout) == []


def test_nodes_links_prints_the_measured_matrix_and_json(
    racon: Run, two_nodes: tuple[Node, Node]
) -> None:
    res = racon("nodes", "links")
    assert res.exit_code == 0, res.output
    assert "No links measured yet" in res.stdout
    alpha, beta = two_nodes
    link_record(
        node_id=ids.node_id(alpha.id),
        links=[
            {
                "node_id": str(beta.id),
                "rtt_ms": 0.512,
                "bandwidth_mbps": 941.5,
                "rtt_method": "tunnel-echo",
                "bandwidth_method": "measured",
            }
        ],
        now=timezone.now(),
    )
    res = racon("nodes", "links")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["FROM", "TO", "RTT", "MS", "MBIT/S", "METHOD", "AGE"]
    row = next(ln for ln in lines if ln.startswith("alpha"))
    assert row.split()[:5] == ["alpha", "beta", "0.512", "941.5", "measured"]
    data = json.loads(racon("nodes", "links", "--json").stdout)
    assert data["links"][0]["bandwidth_mbps"] == 941.5 and data["links"][0]["expired"] is False
    assert data["max_age_seconds"] > 0
