"""racon-desktop's parts that need no display (issue 31): the tray's state and colours, the
earnings series, where it finds the agent, pause without an agent, the narrow commands, and that
its page loads nothing but its own files (uPlot included, the web UI's vendored copy)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
from datetime import date
from pathlib import Path
from typing import Any

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
from tests.support.unavailable import unavailable

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "desktop" / "racon_desktop"


def _app() -> object:
    if importlib.util.find_spec("pytauri_wheel") is None:
        unavailable(
            "pytauri-wheel (the 'desktop' extra) is missing: make install",
            under_ci="(under CI it must be installed)",
        )
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

    names = {"snapshot", "earnings", "lending_get", "lending_set", "pause", "resume",
             "join_info", "join_check", "join_start", "join_progress", "notify_get", "notify_set",
             "dashboard"}  # fmt: skip
    for name in names:
        fn = getattr(commands, name)
        params = set(inspect.signature(fn).parameters)
        assert params <= {"body"}, (name, params)
    assert set(commands.LendingForm.model_fields) == {
        "timezone", "windows", "handoff", "idle_minutes", "cpu_below", "ram_gb", "vram_gb",
        "threads",
    }  # fmt: skip
    # The join line is parsed (never run); the switches are booleans.
    assert set(commands.JoinForm.model_fields) == {"line"}
    assert {f.annotation for f in commands.NotifyForm.model_fields.values()} == {bool}


@pytest.mark.parametrize(("page", "script"), [("index.html", "app.js"), ("join.html", "join.js")])
def test_the_page_loads_only_its_own_files(page: str, script: str) -> None:
    html = (PKG / "frontend" / page).read_text()
    js = (PKG / "frontend" / script).read_text()
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


# --- the window loads only its own pages -------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("tauri://localhost/index.html", True),
        ("tauri://localhost/join.html", True),
        ("http://tauri.localhost/index.html", True),  # Windows' app origin
        ("tauri://localhost.evil.example/", False),
        ("https://example.com/", False),
        ("http://127.0.0.1:8000/nodes/", False),  # the controller's pages open in the browser
        ("file:///etc/passwd", False),
        ("about:blank", False),
    ],
)
def test_navigation_is_only_to_the_apps_own_pages(url: str, allowed: bool) -> None:
    assert _app().navigation_allowed(url) is allowed  # type: ignore[attr-defined]


# --- the first-run join: the line is parsed, never run --------------------------------------------

PIN = "sha256//" + "q" * 43 + "="


def test_the_join_lines_token_is_the_controllers() -> None:
    from racon_desktop.join import TOKEN_RE

    from apps.nodes.join_urls import TOKEN

    assert TOKEN == f"(?P<token>{TOKEN_RE.pattern})"


def test_the_pin_is_curls_and_the_controllers(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding
    from racon_desktop.join import spki_pin

    from racon.tls import ca_load_or_create
    from racon.tls import spki_pin as controllers_pin

    ca, _ = ca_load_or_create(var_dir=tmp_path)
    assert spki_pin(ca.cert.public_bytes(Encoding.DER)) == controllers_pin(ca.cert)


def test_the_controllers_own_lines_parse(settings: Any) -> None:
    """The lines the token page gives (apps/nodes/join.py), pinned https and loopback http."""
    from racon_desktop.join import parse_join_line

    from apps.nodes.join import join_command_line, join_python_line

    settings.CONTROLLER_PUBLIC_URL = "https://192.168.7.2:8443"
    settings.TLS_PIN = PIN
    settings.INSECURE_LAN = False
    tok = "rcn_" + "A1_-" * 8
    for line in (join_command_line(token=tok), join_python_line(token=tok)):
        got = parse_join_line(line, env={})
        assert (got.controller, got.token, got.pin) == ("https://192.168.7.2:8443", tok, PIN), line
    settings.CONTROLLER_PUBLIC_URL = "http://127.0.0.1:8000"
    settings.TLS_PIN = ""
    line = join_command_line(token=tok) + " -s -- --node-name desk --no-benchmark"
    got = parse_join_line(line, env={})
    assert (got.controller, got.pin, got.args) == (
        "http://127.0.0.1:8000", "", ("--node-name", "desk", "--no-benchmark"),
    )  # fmt: skip
    assert parse_join_line(tok, controller="http://127.0.0.1:8000", env={}).token == tok


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("", "paste the join line"),
        ("rcn_", "token is malformed"),
        ("rcn_abc", "a token alone does not say which controller"),
        ("rcn_ab cd", "token is malformed"),
        ("curl -fsSL http://127.0.0.1:8000/join/rcn_a | sh; rm -rf ~", "more than one command"),
        ("curl -fsSL http://127.0.0.1:8000/join/rcn_a | sh && reboot", "more than one command"),
        ("curl -fsSL http://127.0.0.1:8000/join/rcn_a | sh -s -- '$(id)'", "plain words"),
        ("curl -fsSL http://127.0.0.1:8000/join/rcn_a | bash -c 'id'", "only `-s -- ARGS`"),
        ("curl -fsSL 'http://127.0.0.1:8000/join/rcn_a | sh", "quoting is broken"),
        ("curl -o /tmp/x http://127.0.0.1:8000/join/rcn_a | sh", "'-o' is not part"),
        ("wget -qO- http://127.0.0.1:8000/join/rcn_a | sh", "starts with curl"),
        ("curl -fsSL http://127.0.0.1:8000/join/rcn_a", "neither a join line"),
        ("curl -fsSL http://127.0.0.1:8000/other/rcn_a | sh", "not a join URL"),
        ("curl -fsSL http://192.168.1.9:8000/join/rcn_a | sh", "plain http on a network"),
        (f"curl -fsSL --pinnedpubkey {PIN} http://127.0.0.1/join/rcn_a | sh", "plain http"),
        ("curl -fsSLk --pinnedpubkey sha256//abc https://h:1/join/rcn_a | sh", "pin"),
        ("curl -fsSL http://u:p@127.0.0.1/join/rcn_a | sh", "never has"),
        ("curl -fsSL http://127.0.0.1/join/rcn_a\ncurl x | sh", "one line"),
        ("curl -fsSL http://127.0.0.1/join/rcn_a | sh\nid", "one line"),
    ],
)
def test_a_malformed_line_says_what_is_wrong(line: str, says: str) -> None:
    from racon_desktop.join import JoinLineError, parse_join_line

    with pytest.raises(JoinLineError, match=re.escape(says)):
        parse_join_line(line, env={})


@pytest.mark.django_db(transaction=True)
def test_a_refused_token_installs_nothing(live_server: Any, settings: Any, tmp_path: Path) -> None:
    """The controller's answer for a token it does not know is shown, and nothing is written:
    the preview and the join script's fetch both stop before anything runs."""
    from racon_desktop.join import Join, JoinLineError, parse_join_line, preview

    settings.CONTROLLER_PUBLIC_URL = live_server.url
    line = parse_join_line(f"curl -fsSL {live_server.url}/join/rcn_unknownToken123 | sh", env={})
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    state = home / ".local" / "state" / "racon-agent"
    with pytest.raises(JoinLineError, match="invalid"):
        preview(line, state_dir=state, env=env)
    job = Join(line=line, state_dir=state, log_path=home / "join.log")
    with pytest.raises(JoinLineError, match="invalid"):
        job.start(env)
    assert job.proc is None and list(home.iterdir()) == []


# --- notifications the owner can switch off ------------------------------------------------------


def test_notifications_fire_on_transitions_and_stop_when_switched_off(tmp_path: Path) -> None:
    from racon_desktop.notify import Notifier, settings_path

    shown: list[tuple[str, str]] = []
    n = Notifier(
        settings_path({"XDG_CONFIG_HOME": str(tmp_path)}), lambda t, b: shown.append((t, b))
    )
    node = {"name": "desk", "state": "READY", "last_challenge_failure": None}
    drained = {**node, "state": "DRAINED", "paused": True}
    n.observe("", "READY", node, "")
    n.observe("READY", "DRAINING", {**node, "state": "DRAINING"}, "")
    n.observe("DRAINING", "PAUSED", drained, "")
    n.observe("PAUSED", "PAUSED", drained, "")  # once per drain
    assert shown == [("RACoN: desk paused", "Lending is paused: the running work was handed off.")]
    n.observe("PAUSED", "OFFLINE", None, "controller unreachable at http://x")
    assert shown[-1] == ("RACoN: this machine is OFFLINE", "controller unreachable at http://x")
    # A new failed challenge (the first one seen is the baseline: n saw none before).
    failed = {**node, "last_challenge_failure": {"id": 7, "message": "speed claim refuted"}}
    n.observe("OFFLINE", "READY", failed, "")
    assert shown[-1][1] == "speed claim refuted"
    n.observe("READY", "READY", failed, "")  # the same failure: once
    assert len(shown) == 3

    assert n.set_switches({"paused": False, "offline": True}) == {
        "offline": True, "challenge": True, "paused": False, "earnings": True,
    }  # fmt: skip
    n.observe("READY", "READY", node, "")
    n.observe("READY", "PAUSED", drained, "")
    assert len(shown) == 3  # switched off: nothing shown
    saved = json.loads((tmp_path / "racon-desktop" / "settings.json").read_text())
    assert saved["notify"]["paused"] is False


def test_the_daily_earnings_once_a_day(tmp_path: Path) -> None:
    from racon_desktop.notify import Notifier

    shown: list[tuple[str, str]] = []
    n = Notifier(tmp_path / "s.json", lambda t, b: shown.append((t, b)))
    rows = [{"day": "2026-03-01", "credits": 1_500_000, "jobs": 3}]
    n.daily(date(2026, 3, 1), lambda: rows)  # the first day only records the date
    n.daily(date(2026, 3, 2), lambda: rows)
    n.daily(date(2026, 3, 2), lambda: rows)
    assert shown == [("RACoN: 1.500000 credits yesterday", "3 jobs served on 2026-03-01.")]
    n.set_switches({"earnings": False})
    n.daily(date(2026, 3, 3), lambda: rows)
    assert len(shown) == 1
