"""The window's Python commands. Narrow on purpose: no command takes a path, a URL or a shell
string (any page the window loads could call them all; it loads only the app's own pages)."""

from __future__ import annotations

import os

os.environ.setdefault("_PYTAURI_DIST", "pytauri-wheel")  # before any pytauri import

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, RootModel
from pytauri import Commands

from .agent_api import AgentError, Controller, ControllerError, earnings_series

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


_bound: dict[str, Any] = {}


def bind(model: Any, controller: Controller) -> None:
    _bound["model"], _bound["controller"] = model, controller


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
    return Json(_bound["model"].snapshot())


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
