"""The `node-agent` command as a real process: foreground + SIGTERM, detached + status/stop, doctor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.identity import Identity, save_identity
from tests.agent.harness import REDIS_URL, REPO, FakeController, fake_profile, free_port


def node_agent(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 60),
        **kw,
    )


@pytest.fixture
def run_flags(controller: FakeController, tmp_path: Path) -> list[str]:
    (tmp_path / "models").mkdir()
    return [
        "--controller-url",
        controller.url,
        "--enrollment-token",
        controller.token,
        "--node-name",
        "cli-node",
        "--state-dir",
        str(tmp_path / "state"),
        "--models-dir",
        str(tmp_path / "models"),
        "--hardware-profile",
        str(fake_profile(tmp_path)),
        "--advertise-address",
        "127.0.0.1",
        "--rpc-port",
        str(free_port()),
        "--no-rpc-worker",
        "--no-benchmark",
        "--drain-seconds",
        "2",
    ]


@pytest.fixture
def reaper(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Whatever a test starts is stopped when it ends, detached agents included."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    pid_file = tmp_path / "state" / "agent.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _forget_nodes(controller: FakeController, redis_client: Any) -> None:
    for nid in controller.node_ids:
        redis_client.test_keys.append(f"racon:node:{nid}:*")


def test_foreground_agent_becomes_ready_and_sigterm_drains_and_exits_zero(
    controller: FakeController,
    run_flags: list[str],
    reaper: list[Any],
    redis_client: Any,
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "--foreground", *run_flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    reaper.append(proc)
    controller.wait_for(lambda c: [b for b in c.heartbeats if b["state"] == "READY"], timeout=60)
    _forget_nodes(controller, redis_client)
    assert (tmp_path / "state" / "agent.pid").read_text().strip() == str(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert controller.events("NODE_DRAINED")
    assert controller.heartbeats[-1]["state"] == "DRAINING"
    assert not (tmp_path / "state" / "agent.pid").exists()
    assert b"state READY" in out and b"agent stopped (exit 0)" in out


def test_detached_agent_reports_status_and_stops(
    controller: FakeController,
    run_flags: list[str],
    reaper: list[Any],
    redis_client: Any,
    tmp_path: Path,
) -> None:
    state = str(tmp_path / "state")
    started = node_agent(*run_flags)
    assert started.returncode == 0, started.stderr
    assert "node-agent started (pid" in started.stdout
    controller.wait_for(lambda c: [b for b in c.heartbeats if b["state"] == "READY"], timeout=60)
    _forget_nodes(controller, redis_client)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = node_agent("status", "--state-dir", state)
        if "state: READY" in status.stdout:
            break
        time.sleep(0.3)
    assert status.returncode == 0
    assert "process: running" in status.stdout and controller.node_ids[0] in status.stdout
    second = node_agent(*run_flags)  # one agent per state dir
    assert second.returncode == 2 and "already running" in second.stderr
    stop = node_agent("stop", "--state-dir", state)
    assert stop.returncode == 0 and "stopped" in stop.stdout
    after = node_agent("status", "--state-dir", state)
    assert after.returncode == 1 and "not running" in after.stdout
    assert "agent stopped (exit 0)" in (tmp_path / "state" / "agent.log").read_text()


def test_doctor_checks_the_pieces_and_writes_a_bundle_without_the_credential(
    controller: FakeController, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    save_identity(state, Identity("node-doc", "TOPSECRETCRED", controller.url, REDIS_URL, "doc"))
    # A secret that slipped into the logs must still never leave the machine.
    (state / "logs").mkdir(parents=True)
    (state / "agent.log").write_text(
        "debug: Authorization: Node node-doc:TOPSECRETCRED\nredis://u:hunter2@10.0.0.1/0\n"
    )
    (state / "logs" / "primary-dep1.log").write_text("llama.cpp: RPC worker crashed\n")
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").write_bytes(b"GGUF0000")
    bundle = tmp_path / "out" / "bundle.tar.gz"
    out = node_agent(
        "doctor",
        "--state-dir",
        str(state),
        "--models-dir",
        str(models),
        "--hardware-profile",
        str(fake_profile(tmp_path)),
        "--bundle",
        str(bundle),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cpu: Test CPU 9000 (8 cores / 16 threads)" in out.stdout
    for name in ("controller", "redis", "llama.cpp rpc", "models"):
        assert f"[ok] {name}:" in out.stdout, out.stdout
    assert "1 GGUF file(s)" in out.stdout
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        report = json.loads(tar.extractfile("doctor.json").read())
        blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
    assert "doctor.json" in names and "identity.json" not in names
    assert "agent.log" in names and "logs/primary-dep1.log" in names
    assert b"TOPSECRETCRED" not in blob and b"hunter2" not in blob
    assert b"[redacted]" in blob
    assert report["ok"] is True


def test_doctor_fails_when_the_controller_is_down(tmp_path: Path) -> None:
    out = node_agent(
        "doctor",
        "--state-dir",
        str(tmp_path),
        "--controller-url",
        f"http://127.0.0.1:{free_port()}",
        "--hardware-profile",
        str(fake_profile(tmp_path)),
    )
    assert out.returncode == 1
    assert "[FAIL] controller:" in out.stdout
    assert "[skip] redis:" in out.stdout


# --- a command line people can discover (issue 26) ------------------------------------------------


def test_help_lists_every_command_with_one_line_each() -> None:
    from agent.cli import SUBCOMMANDS

    out = node_agent("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in (
        "run",
        "doctor",
        "status",
        "stop",
        "pause",
        "resume",
        "install-service",
        "upgrade",
    ):
        assert name in SUBCOMMANDS
        row = [ln for ln in lines if ln.startswith(f"  {name} ")]
        assert len(row) == 1 and len(row[0].split()) > 2, (name, out.stdout)


def test_each_commands_help_has_an_example() -> None:
    from agent.cli import SUBCOMMANDS

    for name in SUBCOMMANDS:
        out = node_agent(name, "--help")
        assert out.returncode == 0, (name, out.stderr)
        assert out.stdout.startswith(f"usage: node-agent {name}"), out.stdout
        example = out.stdout.split("example:\n", 1)[1].strip()
        assert example.startswith(f"node-agent {name}"), (name, example)


def test_an_unknown_command_or_flag_gets_one_line_naming_the_closest() -> None:
    cmd = node_agent("stauts")
    assert cmd.returncode == 2 and cmd.stdout == ""
    assert cmd.stderr.strip().splitlines() == [
        "node-agent: error: unknown command 'stauts'; did you mean 'status'? "
        "(`node-agent --help` lists the commands)"
    ]
    flag = node_agent("--foreground", "--controler-url", "http://127.0.0.1:1")
    assert flag.returncode == 2
    assert len(flag.stderr.strip().splitlines()) == 1, flag.stderr
    assert "unknown flag --controler-url; did you mean --controller-url?" in flag.stderr
    sub = node_agent("stop", "--timout", "3")
    assert sub.returncode == 2 and len(sub.stderr.strip().splitlines()) == 1
    assert "node-agent stop: error: unknown flag --timout; did you mean --timeout?" in sub.stderr
    nothing_near = node_agent("status", "--zzzzzz")
    assert "unknown flag --zzzzzz (" in nothing_near.stderr


def test_the_old_invocation_without_a_command_still_runs_the_agent(tmp_path: Path) -> None:
    # No command means run: its flags are parsed and checked (here: no controller URL given).
    out = node_agent("--foreground", "--state-dir", str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "--controller-url (or RACON_CONTROLLER_URL) is required" in out.stderr
