"""racon-desktop for real, headless (issue 31): the app under ``xvfb-run -a dbus-run-session``,
started by Debian's WebKitWebDriver (``TAURI_WEBVIEW_AUTOMATION=true``), against the suite's
live controller and a real agent that serves SmolLM2 jobs in this test.

- the window (title RACoN) renders the node's state, read through WebDriver;
- the earnings it charts are GET /api/credits/earnings's rows for that node;
- "Pause now" clicked in the live tray menu (the dbusmenu the tray exports, as a panel clicks it:
  tests/desktop/tray.py) puts the node DRAINING on the controller; "Resume" makes it READY;
- a screenshot of the screen is saved to docs/img/desktop.png.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.desktop import tray
from tests.e2e.harness import (
    BIN,
    ROOT,
    Controller,
    consumer_headers,
    free_port,
    replica_per_node,
    smollm2_path,
    start_agent,
    stop_agent,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
SHOT = ROOT / "docs" / "img" / "desktop.png"


class WebDriver:
    """The few W3C WebDriver calls the test needs."""

    def __init__(self, base: str, session: str) -> None:
        self.base, self.session = base, session

    def _url(self, path: str) -> str:
        return f"{self.base}/session/{self.session}{path}"

    def run(self, script: str) -> Any:
        resp = httpx.post(
            self._url("/execute/sync"), json={"script": script, "args": []}, timeout=30
        )
        resp.raise_for_status()
        return resp.json()["value"]

    def text(self, css: str) -> str:
        return str(
            self.run(f"const e = document.querySelector({css!r}); return e ? e.textContent : ''")
        )

    def title(self) -> str:
        return str(httpx.get(self._url("/title"), timeout=30).json()["value"])

    def refresh(self) -> None:
        httpx.post(self._url("/refresh"), json={}, timeout=60).raise_for_status()


@pytest.fixture
def display(tmp_path: Path) -> Iterator[tuple[dict[str, str], str]]:
    """A headless X display and D-Bus session with WebKitWebDriver in it: (their environment,
    the driver's URL). Killed as one process group after."""
    envfile = tmp_path / "display.env"
    port = free_port()
    env = {**os.environ, "TAURI_WEBVIEW_AUTOMATION": "true", "GDK_BACKEND": "x11"}
    script = (
        f'printf "%s\\n%s\\n%s\\n" "$DISPLAY" "$DBUS_SESSION_BUS_ADDRESS" "$XAUTHORITY" > {envfile}; '
        f"exec WebKitWebDriver --port={port}"
    )
    proc = subprocess.Popen(
        ["xvfb-run", "-a", "-s", "-screen 0 1280x900x24", "dbus-run-session", "--",
         "bash", "-c", script],
        env=env, stdout=open(tmp_path / "display.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: envfile.exists() and len(envfile.read_text().splitlines()) == 3, 60,
                 "Xvfb and the D-Bus session")  # fmt: skip
        disp, bus, xauth = envfile.read_text().splitlines()
        base = f"http://127.0.0.1:{port}"

        def driver_up() -> bool:
            try:
                return httpx.get(base + "/status", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(driver_up, 60, "WebKitWebDriver")
        yield {**env, "DISPLAY": disp, "DBUS_SESSION_BUS_ADDRESS": bus, "XAUTHORITY": xauth}, base
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def _owner_and_token(live: Controller, name: str) -> tuple[str, str]:
    from tests.e2e.test_cluster import make_account_with_key

    acct, key = make_account_with_key(f"owner-{name}")
    tok = live.post("/api/admin/tokens", {"label": name, "account": acct})
    assert tok.status_code == 201, tok.text
    return key, tok.json()["token"]


def _model_name(live: Controller, path: Path) -> str:
    """A registered name for the SmolLM2 file (registered here unless the session already did)."""
    created = live.post("/api/admin/models", {"path": str(path), "name": "desk-smollm2"})
    if created.status_code in (200, 201):
        # The file may be registered already (another test of the session): its model's name.
        return str(created.json()["name"])
    for m in live.get("/api/admin/models").json():
        rows = m if isinstance(m, list) else [m]
        for r in rows:
            if isinstance(r, dict) and str(r.get("path", "")).endswith(path.name):
                return str(r["name"])
    raise AssertionError(f"could not register {path}: {created.status_code} {created.text}")


def test_the_desktop_app_shows_the_node_charts_its_pay_and_pauses_from_the_tray(
    desktop_ready: None, live: Controller, tmp_path: Path, display: tuple[dict[str, str], str]
) -> None:
    env, driver_url = display
    owner_key, token = _owner_and_token(live, "desk-1")
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    model_path = smollm2_path()
    try:
        os.link(model_path, models_dir / model_path.name)
    except OSError:
        import shutil

        shutil.copy(model_path, models_dir / model_path.name)
    agent = start_agent(live, token, "desk-1", tmp_path, models_dir=models_dir)
    session = ""
    try:
        node = wait_for(
            lambda: next(
                (
                    n
                    for n in live.get("/api/admin/nodes?state=READY").json()
                    if n["name"] == "desk-1"
                ),
                None,
            ),
            120,
            "the agent READY",
        )
        node_id = node["id"]

        # The node serves two jobs in this run, so it has earnings today.
        model = _model_name(live, model_path)
        replica_per_node(live, model, ("desk-1",), n_ctx=512)
        consumer = consumer_headers("desk-consumer")

        def earned() -> list[dict[str, Any]] | None:
            rows = httpx.get(
                f"{live.url}/api/credits/earnings?days=30&node={node_id}",
                headers={"Authorization": f"Bearer {owner_key}"},
                timeout=30,
            ).json()
            return rows if sum(r["jobs"] for r in rows) >= 2 else None

        # Another test's replica of the same file may take some of the jobs: ask until this node
        # has served two (bounded).
        for _ in range(8):
            resp = httpx.post(
                live.url + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 6, "temperature": 0},
                headers=consumer, timeout=180,
            )  # fmt: skip
            assert resp.status_code == 200, resp.text
            if earned():
                break

        rows = wait_for(earned, 120, "the two jobs settled on /api/credits/earnings")

        # The app, started by WebKitWebDriver inside the headless display.
        created = httpx.post(
            driver_url + "/session",
            json={"capabilities": {"alwaysMatch": {"webkitgtk:browserOptions": {
                "binary": str(BIN / "racon-desktop"),
                "args": ["--state-dir", str(agent.state_dir)],
            }}}},
            timeout=120,
        )  # fmt: skip
        assert created.status_code == 200, created.text
        session = created.json()["value"]["sessionId"]
        wd = WebDriver(driver_url, session)

        # The window renders the node's state as the controller has it.
        wait_for(lambda: wd.text("#node-state") == "READY", 60, "the window to show READY")
        assert "RACoN" in wd.title()
        assert wd.text("#node-name") == "desk-1"
        assert wd.text("#jobs-today") == str(
            sum(r["jobs"] for r in rows if r["day"] == rows[0]["day"])
        )

        # The chart's figures are /api/credits/earnings's, for this node.
        def charted() -> Any:
            return wd.run(
                "const e = window.raconEarnings; const c = document.querySelector('#chart canvas');"
                " return e && c ? {rows: e.rows, credits: e.credits, jobs: e.jobs,"
                " drawn: window.raconChartData} : null"
            )

        chart = wait_for(charted, 60, "the earnings chart")
        assert chart["rows"] == rows
        assert sum(chart["credits"]) == sum(r["credits"] for r in rows) > 0
        assert sum(chart["jobs"]) == sum(r["jobs"] for r in rows) >= 2
        # What uPlot draws: the same per-day credits (in credits, not micro-credits).
        assert [round(v * 1e6) for v in chart["drawn"][1]] == chart["credits"]

        SHOT.parent.mkdir(parents=True, exist_ok=True)
        shot = subprocess.run(
            ["import", "-window", "root", "-crop", "980x760+0+0", "+repage", str(SHOT)],
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert shot.returncode == 0, shot.stderr

        # Pause now, clicked in the live tray menu: DRAINING on the controller.
        tray.click(env, "Pause now")

        def controller_state() -> str:
            return str(live.get(f"/api/admin/nodes/{node_id}").json()["state"])

        wait_for(lambda: controller_state() in ("DRAINING", "DRAINED"), 60, "the node DRAINING")
        wait_for(lambda: wd.text("#node-state") in ("DRAINING", "PAUSED"), 60,
                 "the window to show the pause")  # fmt: skip
        assert "paused" in wd.text("#message")

        tray.click(env, "Resume")
        wait_for(lambda: controller_state() == "READY", 60, "the node READY after Resume")
        wait_for(lambda: wd.text("#node-state") == "READY", 60, "the window to show READY")
    finally:
        if session:
            httpx.delete(f"{driver_url}/session/{session}", timeout=30)
        stop_agent(agent)
