"""Human output: rich tables and small formatters. Machine output (--json) bypasses all of this."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

STATE_STYLE = {
    "READY": "green",
    "BUSY": "blue",
    "DRAINING": "yellow",
    "DRAINED": "dim yellow",
    "DEGRADED": "yellow",
    "OFFLINE": "dim",
    "ERROR": "red",
    "REGISTERING": "magenta",
    "UNINITIALIZED": "dim",
    "PLANNING": "magenta",
    "LOADING": "magenta",
    "FAILED": "red",
    "STOPPED": "dim",
    "QUEUED": "magenta",
    "DISPATCHED": "blue",
    "RUNNING": "blue",
    "COMPLETED": "green",
    "CANCELLED": "dim",
    "active": "green",
    "revoked": "dim",
    "expired": "dim",
    "used up": "dim",
}
NODE_COLOURS = (
    "blue",
    "green",
    "yellow",
    "magenta",
    "red",
    "cyan",
    "bright_green",
    "bright_magenta",
)


def console() -> Console:
    # Piped output (scripts, tests) gets a wide fixed width so tables never fold names.
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False, soft_wrap=False)


def err(message: str) -> None:
    """One line on stderr, never wrapped or styled."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def state(value: Any) -> Text:
    return Text(str(value), style=STATE_STYLE.get(str(value), ""))


def human_bytes(n: Any) -> str:
    try:
        v = float(n or 0)
    except (TypeError, ValueError):
        return "-"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(v) >= size:
            return f"{v / size:.1f} {unit}"
    return f"{int(v)} B"


def credits(micro: Any) -> str:
    if micro is None:
        return "-"
    return f"{int(micro) / 1_000_000:,.3f}"


def short_id(value: Any) -> str:
    return str(value or "")[:8]


def when(value: Any) -> str:
    if not value:
        return "-"
    try:
        dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return str(value)
    return dt.strftime("%Y-%m-%d %H:%M:%S")


def age(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    return f"{s:.1f}s" if s < 60 else f"{s / 60:.0f}m" if s < 3600 else f"{s / 3600:.1f}h"


def num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{float(value):,.{digits}f}"


def table(*columns: str, title: str | None = None) -> Table:
    t = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        box=None,
        pad_edge=False,
        show_edge=False,
    )
    for c in columns:
        t.add_column(
            c,
            no_wrap=True,
            justify="right"
            if c in {"CORES", "LAYERS", "TOKENS", "TOK/S", "AMOUNT", "CREDITS", "USES", "CTX"}
            else "left",
        )
    return t


def kv(rows: list[tuple[str, Any]], title: str | None = None) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="dim", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, v if isinstance(v, Text) else str(v))
    return t


def layer_bar(plan: dict[str, Any]) -> tuple[Text, list[tuple[str, str, int, int]]]:
    """A line of n_layer blocks coloured by node, and the legend (name, colour, layers, bytes)."""
    n_layer = int(
        plan.get("n_layer") or max((d["layer_end"] for d in plan.get("devices", [])), default=0)
    )
    owner: list[str | None] = [None] * n_layer
    colour: dict[str, str] = {}
    legend: dict[str, list[Any]] = {}
    for d in plan.get("devices", []):
        name = d.get("node_name") or short_id(d["node_id"])
        colour.setdefault(name, NODE_COLOURS[len(colour) % len(NODE_COLOURS)])
        entry = legend.setdefault(name, [name, colour[name], 0, 0])
        entry[2] += int(d.get("n_layers") or d["layer_end"] - d["layer_start"])
        entry[3] += int(d.get("memory_bytes") or 0)
        for i in range(max(0, d["layer_start"]), min(n_layer, d["layer_end"])):
            owner[i] = name
    primary = plan.get("primary_name")
    bar = Text()
    for name in owner:
        name = name or primary
        bar.append("█", style=colour.get(name or "", "white"))
    return bar, [tuple(v) for v in legend.values()]
