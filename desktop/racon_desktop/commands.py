"""The window's Python commands. Narrow on purpose: no command takes a path, a URL or a shell
string (any page the window loads could call them all; it loads only the app's own pages). The
join line is the one text that reaches Python: it is parsed (join.parse_join_line) into a
controller origin, a pin, a token and plain-word agent arguments, and never run by a shell."""

from __future__ import annotations

import os
import threading
import webbrowser

os.environ.setdefault("_PYTAURI_DIST", "pytauri-wheel")  # before any pytauri import

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, RootModel
from pytauri import Commands

from .agent_api import (
    AgentError,
    Controller,
    ControllerError,
    LocalAgent,
    controller_for,
    earnings_series,
)
from .join import Join, JoinLineError, parse_join_line, preview
from .notify import KINDS

commands = Commands()
Json = RootModel[Any]


class LendingForm(BaseModel):
    """The web UI's lending form fields (/nodes/<id>/lending), as text."""

    timezone: str = ""
    windows: str = ""
    handoff: str = ""
    idle_minutes: str = ""
    cpu_below: str = ""
    ram_gb: str = ""
    vram_gb: str = ""
    threads: str = ""


class JoinForm(BaseModel):
    line: str = ""


class NotifyForm(BaseModel):
    offline: bool = True
    challenge: bool = True
    paused: bool = True
    earnings: bool = True


_bound: dict[str, Any] = {}
BLOCKED: list[str] = []  # navigations the window refused (app.navigation_allowed), newest last
OPENED: list[str] = []  # what Open dashboard handed to the browser


def bind(model: Any, controller: Controller) -> None:
    _bound["model"], _bound["controller"] = model, controller


def bind_join(*, state_dir: Any, controller_hint: str | None, on_joined: Any) -> None:
    _bound["join_state_dir"] = state_dir
    _bound["join_hint"] = controller_hint
    _bound["on_joined"] = on_joined


def open_dashboard() -> str:
    """The node's page on the controller, in the owner's browser (never in this window)."""
    node = _bound["model"].node or {}
    base = _bound["controller"].base
    url = f"{base}/nodes/{node['id']}/" if node.get("id") else f"{base}/"
    OPENED.append(url)
    webbrowser.open(url)
    return url


def _say(said: str) -> str:
    model = _bound["model"]
    with model.lock:
        model.message = said
    return said


def do_pause() -> str:
    """What ``node-agent pause`` does (the state dir): DRAINING, running work handed over."""
    try:
        return _say(_bound["model"].agent.pause())
    except AgentError as exc:
        return _say(str(exc))


def do_resume() -> str:
    try:
        return _say(_bound["model"].agent.resume())
    except AgentError as exc:
        return _say(str(exc))


@commands.command()
async def snapshot() -> Json:
    model = _bound.get("model")
    if model is None:
        return Json({"state": "OFFLINE", "joined": False, "blocked": list(BLOCKED)})
    return Json({"joined": True, **model.snapshot(), "opened": list(OPENED)})


# --- first run: the join ---------------------------------------------------------------------


@commands.command()
async def join_info() -> Json:
    job = _bound.get("join")
    return Json(
        {
            "state_dir": str(_bound.get("join_state_dir") or ""),
            "controller": _bound.get("join_hint") or "",
            "joined": _bound.get("model") is not None,
            "progress": job.view() if job else None,
        }
    )


@commands.command()
async def join_check(body: JoinForm) -> Json:
    """What the line will install here; nothing is written."""
    try:
        line = parse_join_line(body.line, controller=_bound.get("join_hint"))
        return Json(preview(line, state_dir=_bound["join_state_dir"], env=os.environ))
    except JoinLineError as exc:
        return Json({"error": str(exc)})


@commands.command()
async def join_start(body: JoinForm) -> Json:
    if _bound.get("join") is not None and not _bound["join"].error:
        return Json({"error": "a join is already running"})
    state_dir = _bound["join_state_dir"]
    try:
        line = parse_join_line(body.line, controller=_bound.get("join_hint"))
        job = Join(
            line=line, state_dir=state_dir, log_path=state_dir.parent / "racon-desktop" / "join.log"
        )
        job.start(os.environ)
    except JoinLineError as exc:
        return Json({"error": str(exc)})
    _bound["join"] = job

    def node_state() -> str | None:
        try:
            agent = LocalAgent(state_dir)
            ctl = controller_for(agent)
            try:
                return str(ctl.node().get("state") or "")
            finally:
                ctl.close()
        except (AgentError, ControllerError):
            return None

    def follow() -> None:
        job.follow(node_state)
        if job.view()["done"]:
            _bound["on_joined"]()

    threading.Thread(target=follow, daemon=True).start()
    return Json({"started": True, **job.view()})


@commands.command()
async def join_progress() -> Json:
    job = _bound.get("join")
    if job is None:
        return Json({"steps": [], "error": "", "done": False})
    return Json({**job.view(), "joined": _bound.get("model") is not None})


# --- notifications ---------------------------------------------------------------------------


@commands.command()
async def notify_get() -> Json:
    model = _bound.get("model")
    if model is None or model.notifier is None:
        return Json({"switches": {k: True for k in KINDS}, "kinds": KINDS})
    return Json({"switches": model.notifier.switches(), "kinds": KINDS})


@commands.command()
async def notify_set(body: NotifyForm) -> Json:
    model = _bound.get("model")
    if model is None or model.notifier is None:
        return Json({"error": "not joined yet"})
    return Json({"switches": model.notifier.set_switches(body.model_dump()), "kinds": KINDS})


@commands.command()
async def dashboard() -> Json:
    return Json({"opened": open_dashboard()})


@commands.command()
async def earnings() -> Json:
    try:
        rows = _bound["controller"].earnings(days=30)
    except ControllerError as exc:
        return Json({"error": str(exc)})
    return Json({"rows": rows, **earnings_series(rows, days=30, today=datetime.now(UTC).date())})


@commands.command()
async def lending_get() -> Json:
    try:
        return Json(_bound["controller"].lending())
    except ControllerError as exc:
        return Json({"error": {"message": str(exc), "field": exc.field}})


@commands.command()
async def lending_set(body: LendingForm) -> Json:
    try:
        return Json({"saved": True, **_bound["controller"].set_lending(body.model_dump())})
    except ControllerError as exc:
        return Json({"error": {"message": str(exc), "field": exc.field or "form"}})


@commands.command()
async def pause() -> Json:
    return Json({"message": do_pause()})


@commands.command()
async def resume() -> Json:
    return Json({"message": do_resume()})
