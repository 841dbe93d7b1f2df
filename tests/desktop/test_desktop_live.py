"""racon-desktop for real, headless (issue 31): the app under ``xvfb-run -a dbus-run-session``,
started by Debian's WebKitWebDriver (``TAURI_WEBVIEW_AUTOMATION=true``), against the suite's
live controller and a real agent that serves SmolLM2 jobs in this test.

- the window (title RACoN) renders the node's state, read through WebDriver;
- the earnings it charts are GET /api/credits/earnings's rows for that node;
- "Pause now" clicked in the live tray menu (the dbusmenu the tray exports, as a panel clicks it:
  tests/desktop/tray.py) puts the node DRAINING on the controller; "Resume" makes it READY;
- a pause that finished handing off is a desktop notification (a real Notify call on the
  session bus, dunst showing it), and none once the owner switched that notification off;
- Open dashboard (tray) hands the node's page on the controller to the browser; Lending settings
  (tray) brings the form up; a policy the controller refuses marks the field with the
  controller's own message, and a good one is saved;
- the window refuses to navigate away from the app's own pages;
- a screenshot of the screen is saved to var/desktop/desktop.png (docs/img/desktop.png only with
  RACON_UPDATE_SCREENSHOT=1: the README's copy is not rewritten by every run).

test_an_unreachable_controller_shows_in_the_tray_and_backs_off needs no live controller: the tray
and the window say the controller is unreachable, and the retries back off.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.jobs.settle_queue import settle_idle
from tests.desktop import tray
from tests.desktop.headless import Desktop, desktop
from tests.e2e.harness import (
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
SHOT = ROOT / "var" / "desktop" / "desktop.png"
README_SHOT = ROOT / "docs" / "img" / "desktop.png"


def _owner_and_token(live: Controller, name: str) -> tuple[str, str]:
    from tests.e2e.harness import make_account_with_key

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


def _browser(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the owner's browser (Python's webbrowser runs $BROWSER URL): it records."""
    opened = tmp_path / "opened.txt"
    script = tmp_path / "browser"
    script.write_text(f'#!/bin/sh\necho "$1" >> {opened}\n')
    script.chmod(0o755)
    return script, opened


def test_the_desktop_app_shows_the_node_charts_its_pay_and_pauses_from_the_tray(
    desktop_ready: None, live: Controller, tmp_path: Path
) -> None:
    browser, opened = _browser(tmp_path)
    with desktop(tmp_path, BROWSER=str(browser)) as d:
        _the_node_its_pay_and_the_tray(live, tmp_path, d, opened)


def _the_node_its_pay_and_the_tray(
    live: Controller, tmp_path: Path, d: Desktop, opened: Path
) -> None:
    env = d.env
    owner_key, token = _owner_and_token(live, "desk-1")
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    model_path = smollm2_path()
    try:
        os.link(model_path, models_dir / model_path.name)
    except OSError:
        shutil.copy(model_path, models_dir / model_path.name)
    agent = start_agent(live, token, "desk-1", tmp_path, models_dir=models_dir)
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

        wait_for(earned, 120, "the two jobs settled on /api/credits/earnings")
        # Settlement runs in batches (apps/jobs/settle_queue.py): a job sent before the two were
        # counted may still be settling. Read the rows once nothing is queued for settlement.
        wait_for(settle_idle, 60, "the settlement queue to drain")
        rows = earned() or []

        # The app, started by WebKitWebDriver inside the headless display.
        wd = d.start_app("--state-dir", str(agent.state_dir))

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

        d.screenshot(SHOT)
        if os.environ.get("RACON_UPDATE_SCREENSHOT") == "1":  # the README's copy, on request
            shutil.copy(SHOT, README_SHOT)

        # Pause now, clicked in the live tray menu: DRAINING on the controller.
        tray.click(env, "Pause now")

        def controller_state() -> str:
            return str(live.get(f"/api/admin/nodes/{node_id}").json()["state"])

        wait_for(lambda: controller_state() in ("DRAINING", "DRAINED"), 60, "the node DRAINING")
        wait_for(lambda: wd.text("#node-state") in ("DRAINING", "PAUSED"), 60,
                 "the window to show the pause")  # fmt: skip
        # The tray's pause returns its message once the agent confirms, and the window shows the
        # state from its own poll (every 2 s): either may come first.
        wait_for(lambda: "paused" in wd.text("#message"), 30, "the window to say it paused")

        # The pause handed its work off: a desktop notification (a Notify call on this bus).
        wait_for(lambda: controller_state() == "DRAINED", 60, "the node DRAINED")
        wait_for(lambda: "RACoN: desk-1 paused" in d.notifications(), 30,
                 "the pause's notification")  # fmt: skip
        wait_for(lambda: "paused" in wd.text("#notified"), 30, "the window to list it")

        tray.click(env, "Resume")
        wait_for(lambda: controller_state() == "READY", 60, "the node READY after Resume")
        wait_for(lambda: wd.text("#node-state") == "READY", 60, "the window to show READY")

        # Switched off in the window: the next pause shows nothing.
        wd.run("document.querySelector('#notify-form [name=paused]').click(); return 1")
        settings = tmp_path / "config" / "racon-desktop" / "settings.json"
        wait_for(
            lambda: (
                settings.exists()
                # The file holds other state too (written atomically): wait for the switch.
                and (json.loads(settings.read_text()).get("notify") or {}).get("paused") is False
            ),
            30,
            "the switch saved",
        )
        shown = len(d.notifications())
        tray.click(env, "Pause now")
        wait_for(lambda: controller_state() == "DRAINED", 60, "the node DRAINED again")
        wait_for(lambda: wd.text("#node-state") == "PAUSED", 60, "the window to show PAUSED")
        assert len(d.notifications()) == shown, d.notifications()
        tray.click(env, "Resume")
        wait_for(lambda: controller_state() == "READY", 60, "the node READY after Resume")

        # Open dashboard: the node's page on the controller, in the browser.
        tray.click(env, "Open dashboard")
        wait_for(lambda: opened.exists(), 30, "the browser to be asked")
        url = opened.read_text().split()[0]
        assert url == f"{live.url}/nodes/{node_id}/"
        page = httpx.get(url, timeout=30)
        assert page.status_code in (200, 302), page.status_code  # the page (or its login)

        # Lending settings: the form; the controller refuses cpu_below 150, with its own text.
        from racon_desktop.agent_api import ControllerError, LocalAgent, controller_for

        tray.click(env, "Lending settings")
        ctl = controller_for(LocalAgent(agent.state_dir))
        form = ctl.lending()["form"]
        with pytest.raises(ControllerError) as refused:
            ctl.set_lending({**form, "cpu_below": "150"})
        fill = (
            "const f = document.getElementById('lending-form');"
            "f.elements['cpu_below'].value = arguments[0];"
            "f.requestSubmit(); return 1"
        )
        wd.run(fill.replace("arguments[0]", "'150'"))
        wait_for(lambda: wd.text("#lending-error") == str(refused.value), 30,
                 "the controller's message in the form")  # fmt: skip
        assert wd.run(
            "return document.querySelector('#lending-form [name=cpu_below]')"
            ".classList.contains('invalid')"
        )
        wd.run(fill.replace("arguments[0]", "'90'"))
        wait_for(lambda: wd.text("#lending-saved") == "saved", 30, "the policy saved")
        assert ctl.lending()["form"]["cpu_below"] in ("90", "90.0")
        ctl.set_lending(form)  # as it was

        # The window stays on its own pages.
        wd.run("window.location.href = 'https://example.com/'; return 1")
        wait_for(lambda: "example.com" in wd.text("#blocked"), 30, "the navigation refused")
        assert wd.url() in ("tauri://localhost", "tauri://localhost/index.html"), wd.url()
    finally:
        d.stop_app()
        stop_agent(agent)


def test_an_unreachable_controller_shows_in_the_tray_and_backs_off(
    desktop_ready: None, tmp_path: Path
) -> None:
    """A node whose controller is gone: the tray (its tooltip, through the status file the tray
    writes) and the window say so, and the retries back off (2, 4, 8 … s, at most 60)."""
    from agent.identity import Identity, save_identity

    state = tmp_path / "state"
    state.mkdir()
    dead = f"http://127.0.0.1:{free_port()}"
    save_identity(
        state,
        Identity(
            node_id="n-1", credential="c", controller_url=dead, redis_url="redis://127.0.0.1:1/0"
        ),
    )
    status = tmp_path / "tray.json"
    with desktop(tmp_path, RACON_DESKTOP_STATUS_FILE=str(status)) as d:
        wd = d.start_app("--state-dir", str(state))
        wait_for(status.exists, 60, "the tray's first state")
        tray_now = json.loads(status.read_text())
        assert tray_now["state"] == "OFFLINE"
        assert "controller unreachable" in tray_now["tooltip"]
        wait_for(lambda: "retrying in" in wd.text("#error"), 60, "the window to say it retries")
        assert f"controller unreachable at {dead}" in wd.text("#error")
        seen: list[int] = []

        def backed_off() -> bool:
            text = wd.text("#error")
            if "retrying in " in text:
                n = int(text.rsplit("retrying in ", 1)[1].split()[0])
                if not seen or n != seen[-1]:
                    seen.append(n)
            return len(seen) >= 3

        wait_for(backed_off, 120, "three retries, each later than the one before")
        assert seen == sorted(seen) and seen[-1] > seen[0], seen
