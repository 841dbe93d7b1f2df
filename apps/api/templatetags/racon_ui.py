"""Small formatting filters for the web UI."""

from __future__ import annotations

from typing import Any

from django import template

from apps.api.ui_events import names_in

register = template.Library()

_STATE_TONE = {
    # Node states
    "READY": "ok",
    "BUSY": "busy",
    "DRAINING": "warn",
    "DRAINED": "off",
    "DEGRADED": "warn",
    "OFFLINE": "off",
    "ERROR": "bad",
    "REGISTERING": "info",
    "UNINITIALIZED": "off",
    # Deployment and job states
    "PLANNING": "info",
    "LOADING": "info",
    "FAILED": "bad",
    "STOPPED": "off",
    "QUEUED": "info",
    "DISPATCHED": "info",
    "RUNNING": "busy",
    "COMPLETED": "ok",
    "CANCELLED": "off",
    # Token statuses
    "active": "ok",
    "revoked": "off",
    "expired": "off",
    "used up": "off",
}


@register.filter
def tone(state: Any) -> str:
    """The badge colour classes for a state: its tone, and a colour of its own (``st-offline``)
    so that no two states of a legend look alike."""
    name = str(state)
    base = _STATE_TONE.get(name, "info")
    return f"{base} st-{name.lower()}" if name.isupper() else base


@register.filter
def human_bytes(n: Any) -> str:
    try:
        value = float(n or 0)
    except (TypeError, ValueError):
        return "—"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


@register.filter
def credits(micro: Any) -> str:
    """Micro-credits as credits (1 credit = 1,000,000 µ), three decimals."""
    if micro is None:
        return "—"
    return f"{int(micro) / 1_000_000:,.3f}"


@register.filter
def seconds(value: Any) -> str:
    """A heartbeat age: '0.8 s', '2 min', or '—' when unknown."""
    if value is None or value == "":
        return "—"
    v = float(value)
    if v < 60:
        return f"{v:.1f} s"
    if v < 3600:
        return f"{v / 60:.0f} min"
    return f"{v / 3600:.1f} h"


@register.filter
def number(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return "—"
    return f"{float(value):,.{int(digits)}f}"


@register.filter
def percent(part: Any, whole: Any) -> int:
    """0–100 for a meter's width."""
    try:
        p, w = float(part or 0), float(whole or 0)
    except (TypeError, ValueError):
        return 0
    return 0 if w <= 0 else max(0, min(100, round(100 * p / w)))


@register.filter
def get(mapping: Any, key: Any) -> Any:
    try:
        return mapping.get(key)
    except AttributeError:
        return None


@register.filter
def ids_named(text: Any) -> str:
    """An event message with every node, deployment or job id in it replaced by its name."""
    return names_in(str(text or ""))
