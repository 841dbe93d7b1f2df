"""A clean join: a machine that has never seen the repository runs the one line against a live
controller and turns READY. Scratch HOME, a working directory outside the checkout, no user
site-packages, no pip cache, a PATH without the repository's venv, the system Python 3.12.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Controller, run_controller
from tests.support.join import clean_env
from tests.support.processes import free_port, stop, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def controller(wheelhouse: Path, tmp_path: Path) -> Iterator[Controller]:
    with run_controller(tmp_path / "controller") as ctl:
        yield ctl


def node_state(ctl: Controller, name: str) -> str | None:
    resp = ctl.get("/api/admin/nodes")
    rows = resp.json()
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    return next((n["state"] for n in rows if n["name"] == name), None)


def test_a_clean_machine_joins_with_the_one_line(controller: Controller, machine: Path) -> None:
    tok = controller.post("/api/admin/tokens", {"label": "joiner"}).json()
    token, line = tok["token"], tok["join_command"]
    assert line == f"curl -fsSL {controller.url}/join/{token} | sh"
    name = f"joiner-{free_port()}"
    env = clean_env(
        machine,
        RACON_NODE_NAME=name,
        RACON_ADVERTISE_ADDRESS="127.0.0.1",
        RACON_RPC_PORT=str(free_port()),
        GGML_NO_BACKTRACE="1",
        # This test is the Python route (a venv from served wheels); the standalone bundle's
        # route is tests/join/test_join_bundle.py and tests/cluster/test_household.py.
        RACON_JOIN_ROUTE="python",
    )
    log_path = machine / "join.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["sh", "-c", f"{line[: -len('| sh')]}| sh -s -- --no-benchmark"],
            env=env, cwd=machine / "work", stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(
            lambda: proc.poll() is not None or node_state(controller, name) == "READY",
            300,
            "the joined node to turn READY",
        )
        took = time.monotonic() - started
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert node_state(controller, name) == "READY"
        installed = next(
            (ln for ln in log_path.read_text().splitlines() if "racon join: installed in" in ln), ""
        )
        print(
            f"\njoin: the one line to READY in {took:.1f} s (served wheels; goal <= 90 s); {installed}"
        )
        # The token went only to the credential exchange: no file and no command line holds it.
        for path in machine.rglob("*"):
            if path.is_file() and not path.is_symlink() and path != log_path:
                assert token.encode() not in path.read_bytes(), path
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"node-agent" in cmdline:
                    assert token.encode() not in cmdline
        # Single use: the same line now refuses, with one line, before touching the install.
        again = subprocess.run(
            ["sh", "-c", line], env=env, cwd=machine / "work", capture_output=True, text=True, timeout=60
        )  # fmt: skip
        assert again.returncode != 0 and "has been used" in again.stderr, again.stderr
        # The node upgrades from the controller with its own credential (no token).
        upgraded = subprocess.run(
            [str(machine / ".racon-agent/venv/bin/node-agent"), "upgrade"],
            env=env, cwd=machine / "work", capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert upgraded.returncode == 0, upgraded.stderr + upgraded.stdout
        assert "upgraded 0.1.0 -> 0.1.0" in upgraded.stdout
        assert (machine / ".racon-agent/venv/llama.cpp/bin/llama-server").is_file()
    finally:
        stop(proc, timeout=30)
    print(log_path.read_text()[-1500:])
