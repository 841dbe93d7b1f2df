"""racon-desktop's parts that need no display (issue 31): the tray's state and colours, the
earnings series, where it finds the agent, pause without an agent, the narrow commands, and that
its page loads nothing but its own files (uPlot included, the web UI's vendored copy)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
from datetime import date
from pathlib import Path

import pytest
from racon_desktop.agent_api import (
    AgentError,
    Controller,
    ControllerError,
    LocalAgent,
    earnings_series,
    find_state_dir,
)

from agent.identity import Identity, save_identity

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "desktop" / "racon_desktop"


def _app() -> object:
    if importlib.util.find_spec("pytauri_wheel") is None:
        why = "pytauri-wheel (the 'desktop' extra) is missing: make install"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why} (under CI it must be installed)")
        pytest.skip(why)
    from racon_desktop import app

    return app


@pytest.mark.parametrize(
    ("node", "local", "shown"),
    [
        (None, {}, "OFFLINE"),
        ({"state": "READY"}, {}, "READY"),
        ({"state": "BUSY", "paused": True}, {}, "BUSY"),
        ({"state": "DRAINING", "paused": True}, {}, "DRAINING"),
        ({"state": "DRAINED"}, {}, "PAUSED"),
        ({"state": "READY"}, {"paused": True}, "PAUSED"),
        ({"state": "OFFLINE"}, {}, "OFFLINE"),
        ({"state": "ENROLLING"}, {}, "OFFLINE"),
    ],
)
def test_the_tray_state_is_one_of_five(node: dict | None, local: dict, shown: str) -> None:
    app = _app()
    assert app.shown_state(node, local) == shown  # type: ignore[attr-defined]


def test_each_state_has_its_own_colour() -> None:
    app = _app()
    icons = {s: app.icon_rgba(s, 8) for s in app.COLOURS}  # type: ignore[attr-defined]
    assert len(set(icons.values())) == 5
    centre = icons["READY"][(4 * 8 + 4) * 4 : (4 * 8 + 4) * 4 + 4]
    assert tuple(centre) == (*app.COLOURS["READY"], 255)  # type: ignore[attr-defined]
    assert icons["READY"][3] == 0  # the corner is transparent


def test_the_series_covers_30_days_oldest_first() -> None:
    rows = [
        {"day": "2026-12-03", "credits": 5, "jobs": 1},
        {"day": "2026-12-03", "credits": 7, "jobs": 2},
        {"day": "2026-11-20", "credits": 3, "jobs": 1},
    ]
    s = earnings_series(rows, days=30, today=date(2026, 12, 3))
    assert len(s["days"]) == 30 and s["days"][0] == "2026-11-04" and s["days"][-1] == "2026-12-03"
    assert s["credits"][-1] == 12 and s["jobs"][-1] == 3
    assert sum(s["credits"]) == 15 and sum(s["jobs"]) == 4


def test_it_finds_make_runs_local_agent(tmp_path: Path) -> None:
    ident = Identity(node_id="n", credential="c", controller_url="http://x", redis_url="")
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "RACON_VAR_DIR": str(tmp_path / "var")}
    assert find_state_dir(env) is None
    save_identity(tmp_path / "var" / "agents" / "local-1", ident)
    assert find_state_dir(env) == tmp_path / "var" / "agents" / "local-1"
    save_identity(tmp_path / "state" / "racon-agent", ident)  # a joined machine's agent first
    assert find_state_dir(env) == tmp_path / "state" / "racon-agent"
    assert find_state_dir({**env, "RACON_STATE_DIR": str(tmp_path / "none")}) is None


def test_pause_without_a_running_agent_says_so(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="not running"):
        LocalAgent(tmp_path).pause()
    with pytest.raises(AgentError, match="handoff"):
        LocalAgent(tmp_path).pause(handoff="explode")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x", "javascript:alert(1)", "x"])
def test_the_controller_is_an_http_origin(url: str) -> None:
    with pytest.raises(ControllerError, match="not an http"):
        Controller(url, "Node a:b")


def test_an_unreachable_controller_is_named() -> None:
    ctl = Controller("http://127.0.0.1:9/some/path", "Node a:b", timeout=2)
    assert ctl.base == "http://127.0.0.1:9"  # the origin only
    with pytest.raises(ControllerError, match="controller unreachable at http://127.0.0.1:9"):
        ctl.node()


def test_the_commands_are_narrow() -> None:
    """No command takes a path, a URL or a shell string: only the lending form's fields."""
    _app()
    from racon_desktop import commands

    names = {"snapshot", "earnings", "lending_get", "lending_set", "pause", "resume"}
    for name in names:
        fn = getattr(commands, name)
        params = set(inspect.signature(fn).parameters)
        assert params <= {"body"}, (name, params)
    assert set(commands.LendingForm.model_fields) == {
        "timezone", "windows", "handoff", "idle_minutes", "cpu_below", "ram_gb", "vram_gb",
        "threads",
    }  # fmt: skip


def test_the_page_loads_only_its_own_files() -> None:
    html = (PKG / "frontend" / "index.html").read_text()
    js = (PKG / "frontend" / "app.js").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "http://" not in js and "https://" not in js and "fetch(" not in js
    assert "default-src 'self'" in html  # the CSP
    for f in ("uPlot.iife.min.js", "uPlot.min.css", "VERSION"):  # the web UI's copy of uPlot
        assert (PKG / "frontend" / "vendor" / "uplot" / f).read_bytes() == (
            ROOT / "static" / "vendor" / "uplot" / f
        ).read_bytes()
    conf = json.loads((PKG / "tauri.conf.json").read_text())
    assert "RACoN" in conf["app"]["windows"][0]["title"]
    caps = json.loads((PKG / "capabilities" / "default.json").read_text())
    assert set(caps["permissions"]) == {"core:default", "pytauri:default"}
