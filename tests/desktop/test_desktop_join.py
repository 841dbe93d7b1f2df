"""racon-desktop's first run, for real (issue 31): a machine with no agent (a scratch HOME and
state dir) gets the join window; a malformed line and a token the controller refuses say what is
wrong and install nothing; the token page's own line, pasted, shows what will be installed, then
joins through the controller's join script (the standalone bundle route, the one the line takes
by default: scripts/build-bundle.sh's bundle, cached and shared with
tests/cluster/test_household.py, office-pc) and ends with the node READY on the suite's live
controller, the window showing it. Driven through WebDriver like the other desktop tests.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from agent.cli import read_pid
from tests.desktop.headless import WebDriver, desktop
from tests.e2e.harness import ROOT, Controller, free_port, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
# The first join after agent/ changed waits for the controller's bundle build (about 2 minutes
# idle; generous for a loaded machine).
READY_TIMEOUT = 900


def _paste(wd: WebDriver, line: str, button: str) -> None:
    wd.run(
        "document.getElementById('join-line').value = "
        + json.dumps(line)
        + f"; document.getElementById({button!r}).click(); return 1"
    )


def _node_state(live: Controller, name: str) -> str | None:
    rows = live.get("/api/admin/nodes").json()
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    return next((n["state"] for n in rows if n["name"] == name), None)


def _stop(state: Path) -> None:
    pid = read_pid(state / "agent.pid")
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGTERM)  # the join script's session: the agent and its workers
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and read_pid(state / "agent.pid") is not None:
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_pasted_join_line_ends_with_a_ready_node(
    desktop_ready: None, live: Controller, tmp_path: Path
) -> None:
    from tests.cluster.no_python import build_bundle

    build_bundle()  # the controller's agent bundle for this machine (cached)
    tok = live.post("/api/admin/tokens", {"label": "desk-join"})
    assert tok.status_code == 201, tok.text
    line = tok.json()["join_command"]
    home = tmp_path / "home"
    home.mkdir()
    state = home / ".local" / "state" / "racon-agent"
    name = f"desk-join-{free_port()}"
    with desktop(
        tmp_path,
        HOME=str(home),
        RACON_NODE_NAME=name,
        RACON_ADVERTISE_ADDRESS="127.0.0.1",
        RACON_RPC_PORT=str(free_port()),
        RACON_JOIN_ROUTE="bundle",  # the line's default route, with no fallback to Python
        GGML_NO_BACKTRACE="1",
    ) as d:
        try:
            wd = d.start_app("--state-dir", str(state))
            wait_for(lambda: wd.url().endswith("/join.html"), 60, "the first-run join window")
            assert "RACoN" in wd.title()

            # A malformed line: the window says what is wrong; nothing is installed.
            _paste(wd, line.replace("/join/", "/jion/"), "join-check")
            wait_for(lambda: wd.text("#join-error"), 30, "the malformed line's error")
            assert "is not a join URL" in wd.text("#join-error")
            _paste(wd, line.replace("| sh", "| sh; id"), "join-start")
            wait_for(lambda: "more than one command" in wd.text("#join-error"), 30,
                     "the two-command line refused")  # fmt: skip
            # A token the controller does not know: its own words.
            _paste(wd, f"curl -fsSL {live.url}/join/rcn_notAToken123 | sh", "join-check")
            wait_for(lambda: "invalid" in wd.text("#join-error"), 30, "the refused token")
            assert not (home / ".racon-agent").exists() and not state.exists()

            # The token page's line: what will be installed, then the join.
            _paste(wd, line + " -s -- --no-benchmark", "join-check")
            wait_for(lambda: wd.run("return !document.getElementById('join-preview').hidden"),
                     60, "what the join will install")  # fmt: skip
            installs = wd.text("#join-installs")
            assert "node-agent" in installs and str(home / ".racon-agent") in installs, installs
            assert not (home / ".racon-agent").exists()  # shown, not yet installed
            d.screenshot(ROOT / "var" / "desktop" / "join.png")
            wd.run("document.getElementById('join-start').click(); return 1")
            wait_for(lambda: "fetched the join script" in wd.text("#join-steps"), 60,
                     "the join's progress")  # fmt: skip

            def joined() -> bool:
                failed = wd.text("#join-failed") if wd.url().endswith("/join.html") else ""
                assert not failed, failed
                return wd.url().endswith("/index.html")

            wait_for(joined, READY_TIMEOUT, "the join to end with the node READY")
            assert _node_state(live, name) == "READY"
            wait_for(lambda: wd.text("#node-state") == "READY", 60, "the window to show READY")
            assert wd.text("#node-name") == name
            log = (state.parent / "racon-desktop" / "join.log").read_text(errors="replace")
            assert "racon join: installed in" in log, log[-3000:]
            assert (home / ".racon-agent" / "agent" / "node-agent").is_file()
        finally:
            d.stop_app()
            _stop(state)
