"""``racon-desktop``: the contributor's tray app (Tauri through pytauri-wheel, issue 31).

A window (its own pages in ``frontend/``, nothing else) shows the node's state, what it lends,
jobs served today, earnings per day over 30 days (uPlot, vendored) and the lending policy; a tray
icon whose colour follows the node's state, with Pause now, Resume, Open dashboard, Lending
settings and Quit. Quit closes the app only: the agent keeps running.

Python commands are narrow: none takes a path, a URL or a shell string. The page can only ask
for a snapshot, the earnings, the lending form (to read or set), pause and resume.
"""

from __future__ import annotations

import os

os.environ.setdefault("_PYTAURI_DIST", "pytauri-wheel")  # before any pytauri import

import argparse
import json
import logging
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from anyio.from_thread import start_blocking_portal
from pytauri import BuilderArgs, Manager, WebviewUrl
from pytauri.image import Image
from pytauri.menu import Menu, MenuItem, PredefinedMenuItem
from pytauri.tray import TrayIcon
from pytauri.webview import WebviewWindowBuilder
from pytauri_plugins import notification
from pytauri_wheel.lib import builder_factory, context_factory

from . import commands as cmds
from .agent_api import (
    AgentError,
    Controller,
    ControllerError,
    LocalAgent,
    candidate_state_dirs,
    controller_for,
    find_state_dir,
)
from .notify import Notifier, settings_path

HERE = Path(__file__).resolve().parent
TITLE = "RACoN: this machine"
TRAY_ID = "racon-tray"
MENU_IDS = ("pause", "resume", "dashboard", "lending", "quit")
COLOURS = {
    "READY": (46, 160, 67),
    "BUSY": (31, 111, 235),
    "DRAINING": (219, 139, 0),
    "PAUSED": (130, 80, 223),
    "OFFLINE": (110, 118, 129),
}
POLL_SECONDS = 2.0
BACKOFF_MAX = 60.0
# The window's own pages: Tauri's app origin (tauri://localhost on Linux and macOS,
# http(s)://tauri.localhost on Windows). Every other navigation is refused (on_navigation).
APP_ORIGINS = ("tauri://localhost", "http://tauri.localhost", "https://tauri.localhost")
log = logging.getLogger("racon_desktop")


def navigation_allowed(url: str) -> bool:
    """Only the app's own pages: the controller's pages open in the browser (Open dashboard),
    never in this window, whose pages can call the app's commands."""
    return any(url == o or url.startswith(o + "/") for o in APP_ORIGINS)


def icon_rgba(state: str, size: int = 32) -> bytes:
    """A filled circle in the state's colour (transparent outside)."""
    r, g, b = COLOURS.get(state, COLOURS["OFFLINE"])
    out = bytearray()
    c = (size - 1) / 2
    for y in range(size):
        for x in range(size):
            inside = (x - c) ** 2 + (y - c) ** 2 <= (size / 2 - 1) ** 2
            out += bytes((r, g, b, 255 if inside else 0))
    return bytes(out)


def shown_state(node: dict[str, Any] | None, local: dict[str, Any]) -> str:
    """The tray's state, one of STATES: the controller's READY, BUSY or DRAINING; PAUSED once a
    drain is done (DRAINED) or while the owner's pause holds a node that is not draining;
    OFFLINE when the controller cannot be read or has the node in any other state."""
    if node is None:
        return "OFFLINE"
    state = str(node.get("state") or "OFFLINE")
    paused = bool(node.get("paused") or local.get("paused"))
    if state == "DRAINED":
        return "PAUSED"
    if state in ("DRAINING", "BUSY"):
        return state
    if paused:
        return "PAUSED"
    return state if state in COLOURS else "OFFLINE"


class Model:
    """What the window and the tray show, refreshed by one poller thread with backoff."""

    def __init__(self, agent: LocalAgent, controller: Controller) -> None:
        self.agent = agent
        self.controller = controller
        self.lock = threading.Lock()
        self.node: dict[str, Any] | None = None
        self.error = ""
        self.retry_in = 0.0
        self.focus = ""  # a section the page should scroll to ("lending")
        self.message = ""
        self.listeners: list[Any] = []
        self.notifier: Notifier | None = None

    def snapshot(self) -> dict[str, Any]:
        local = self.agent.lending()
        with self.lock:
            node, error, retry = self.node, self.error, self.retry_in
            focus, self.focus = self.focus, ""
            message = self.message
        return {
            "state": shown_state(node, local),
            "node": node,
            "error": error,
            "retry_in": round(retry),
            "agent_running": self.agent.pid() is not None,
            "local_paused": bool(local.get("paused")),
            "controller": self.controller.base,
            "focus": focus,
            "message": message,
            "blocked": list(cmds.BLOCKED),
            "notified": list(self.notifier.sent) if self.notifier else [],
        }

    def poll_forever(self, stop: threading.Event) -> None:
        delay = POLL_SECONDS
        before = ""
        while not stop.is_set():
            try:
                node = self.controller.node()
            except ControllerError as exc:
                delay = min(BACKOFF_MAX, max(POLL_SECONDS, delay * 2))
                with self.lock:
                    self.node, self.error, self.retry_in = None, str(exc), delay
            else:
                delay = POLL_SECONDS
                with self.lock:
                    self.node, self.error, self.retry_in = node, "", 0.0
            state = self.snapshot_state()
            for fn in list(self.listeners):
                try:
                    fn(state)
                except Exception:  # a listener's failure must not stop the poller
                    log.exception("tray update failed")
            if self.notifier is not None:
                try:
                    with self.lock:
                        node, error = self.node, self.error
                    self.notifier.observe(before, state, node, error)
                    if node is not None:
                        self.notifier.daily(
                            datetime.now().date(), lambda: self.controller.earnings(days=2)
                        )
                except Exception:
                    log.exception("notifications failed")
            before = state
            stop.wait(delay)

    def snapshot_state(self) -> str:
        with self.lock:
            node = self.node
        return shown_state(node, self.agent.lending())


def _status_file() -> Path | None:
    raw = os.environ.get("RACON_DESKTOP_STATUS_FILE")
    return Path(raw) if raw else None


def run(
    agent: LocalAgent | None,
    controller: Controller | None,
    *,
    state_dir: Path,
    controller_hint: str | None = None,
) -> int:
    """The app. With no agent yet (``agent`` None) the window is the first-run join for
    ``state_dir``; once that node is READY the app goes on as if it had found it."""
    tray_ref: dict[str, Any] = {}  # the TrayIcon lives as long as the app: its icon goes with it
    stop = threading.Event()
    shared: dict[str, Any] = {"model": None}

    def attach(handle: Any, agent: LocalAgent, controller: Controller) -> None:
        model = Model(agent, controller)
        shared["model"] = model

        def send(title: str, body: str) -> None:
            notification.NotificationExt.builder(handle).show(title=title, body=body)

        model.notifier = Notifier(settings_path(os.environ), send)
        cmds.bind(model, controller)
        model.listeners.append(tray_ref["on_state"])
        threading.Thread(target=model.poll_forever, args=(stop,), daemon=True).start()

    def joined() -> None:
        agent = LocalAgent(state_dir)
        attach(tray_ref["handle"], agent, controller_for(agent))

    cmds.bind_join(state_dir=state_dir, controller_hint=controller_hint, on_joined=joined)

    def setup(app_handle: Any) -> None:
        tray_ref["handle"] = app_handle
        items = {
            "pause": MenuItem.with_id(app_handle, "pause", "Pause now", True),
            "resume": MenuItem.with_id(app_handle, "resume", "Resume", True),
            "dashboard": MenuItem.with_id(app_handle, "dashboard", "Open dashboard", True),
            "lending": MenuItem.with_id(app_handle, "lending", "Lending settings", True),
            "quit": MenuItem.with_id(app_handle, "quit", "Quit", True),
        }
        sep = PredefinedMenuItem.separator(app_handle)
        menu = Menu.with_items(
            app_handle,
            [items["pause"], items["resume"], sep, items["dashboard"], items["lending"],
             PredefinedMenuItem.separator(app_handle), items["quit"]],
        )  # fmt: skip
        tray = TrayIcon.with_id(app_handle, TRAY_ID)
        tray.set_icon(Image(icon_rgba("OFFLINE"), 32, 32))
        tray.set_tooltip("RACoN: connecting" if agent else "RACoN: not joined yet")
        tray.set_menu(menu)
        tray_ref["tray"], tray_ref["menu"], tray_ref["items"] = tray, menu, items

        def on_menu(handle: Any, menu_id: str) -> None:
            log.info("tray menu: %s", menu_id)
            model = shared["model"]
            if menu_id == "pause" and model is not None:
                threading.Thread(target=cmds.do_pause, daemon=True).start()
            elif menu_id == "resume" and model is not None:
                threading.Thread(target=cmds.do_resume, daemon=True).start()
            elif menu_id == "dashboard" and model is not None:
                threading.Thread(target=cmds.open_dashboard, daemon=True).start()
            elif menu_id == "lending" and model is not None:
                with model.lock:
                    model.focus = "lending"
                win = Manager.get_webview_window(handle, "main")
                if win is not None:
                    win.show()
                    win.set_focus()
            elif menu_id == "quit":
                stop.set()
                handle.exit(0)

        tray.on_menu_event(on_menu)
        last = {"state": ""}

        def on_state(state: str) -> None:
            if state == last["state"]:
                return
            last["state"] = state
            tray.set_icon(Image(icon_rgba(state), 32, 32))
            model = shared["model"]
            error = model.error if model is not None else ""
            tip = f"RACoN: {state}"
            if state == "OFFLINE" and error:
                tip += " (controller unreachable, retrying)"
            tray.set_tooltip(tip)
            items["pause"].set_enabled(state not in ("DRAINING", "PAUSED"))
            status = _status_file()
            if status is not None:  # for tests and scripts: what the tray shows now
                status.write_text(json.dumps({"state": state, "tooltip": tip, "at": time.time()}))

        tray_ref["on_state"] = on_state

        def on_navigation(url: str) -> bool:
            if navigation_allowed(url):
                return True
            log.warning("blocked navigation of the window to %s", url)
            cmds.BLOCKED.append(url)
            del cmds.BLOCKED[:-10]
            return False

        WebviewWindowBuilder.build(
            app_handle,
            "main",
            WebviewUrl.App("index.html" if agent else "join.html"),
            title=TITLE,
            inner_size=(980.0, 760.0),
            on_navigation=on_navigation,
        )
        if agent is not None and controller is not None:
            attach(app_handle, agent, controller)

    config = {
        "productName": "racon-desktop",
        "identifier": "net.racon.desktop",
        "build": {"frontendDist": str(HERE / "frontend")},
        "app": {
            "withGlobalTauri": True,
            # The CSP is the page's own <meta> (pytauri-wheel's assets cannot hash a config CSP).
            # The window is built in setup, with on_navigation (APP_ORIGINS).
            "windows": [],
        },
    }
    with start_blocking_portal("asyncio") as portal:
        args = BuilderArgs(
            context=context_factory(HERE, tauri_config=json.dumps(config)),
            invoke_handler=cmds.commands.generate_handler(portal),
            setup=setup,
            plugins=[notification.init()],
        )
        app = builder_factory().build(**args)
        code = app.run_return()
    stop.set()
    return int(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="racon-desktop", description="RACoN's tray app: this machine's node, lending, pay."
    )
    p.add_argument("--controller-url", help="the controller (default: the agent's own)")
    p.add_argument("--state-dir", help="the agent's state dir (default: found, see --help)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "WARNING"))
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        print(
            "racon-desktop: no display (DISPLAY is unset); headless: xvfb-run -a dbus-run-session -- racon-desktop",
            file=sys.stderr,
        )
        return 2
    # WebKit takes navigator.language from the locale; under LANG=C (a bare container, a CI job)
    # it is "C", which Intl (uPlot's date axis) refuses as a language tag.
    # (WebKit reads LANG even where that locale is not installed.)
    locale = os.environ.get("LC_ALL") or os.environ.get("LC_MESSAGES") or os.environ.get("LANG")
    if (locale or "C").split(".")[0] in ("C", "POSIX"):
        os.environ.pop("LC_ALL", None)
        os.environ.pop("LC_MESSAGES", None)
        os.environ["LANG"] = "en_US.UTF-8"
    explicit = Path(args.state_dir).expanduser() if args.state_dir else None
    state_dir = find_state_dir(os.environ, explicit)
    if state_dir is None:
        # No agent on this machine: the first-run join, for the agent's own state dir.
        target = candidate_state_dirs(os.environ, explicit)[0]
        log.info("no agent found: first-run join into %s", target)
        return run(None, None, state_dir=target, controller_hint=args.controller_url)
    agent = LocalAgent(state_dir)
    try:
        controller = controller_for(agent, args.controller_url)
    except (AgentError, ControllerError) as exc:
        print(f"racon-desktop: {exc}", file=sys.stderr)
        return 1
    return run(agent, controller, state_dir=state_dir)
