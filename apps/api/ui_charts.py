"""The web UI's charts: which series each chart shows, who may see it, and its payload for uPlot.

A page lists its charts as specs (``{"chart": "throughput", "by": "model", ...}``); the page
carries each payload for the first draw and the dashboard socket sends fresh ones when the rollup
is written (``apps/api/consumers.py``). A spec that comes back from the browser is checked again
here: a contributor's charts only ever read their own nodes.

Every payload has the shape racon.js draws: ``x`` (Unix seconds), ``lines`` (``label`` and
``values``), ``unit``, ``step`` and ``kind`` (``line`` or ``bars``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from apps.credits import selectors as credit_selectors
from apps.jobs import series
from apps.nodes.models import Node
from racon import ids

from .ui_render import Viewer, node_for

CHARTS = ("throughput", "ttft", "node_load", "layer_share", "earnings")
FIELDS = {
    "tokens_per_s": ("tokens/s", "line"),
    "requests": ("requests", "bars"),
    "tokens": ("tokens", "bars"),
    "failed": ("failed", "bars"),
}


class ChartRefused(ValueError):
    """A spec names an unknown chart, field or window, or a node this viewer may not see."""


def _window(spec: dict[str, Any]) -> str:
    window = str(spec.get("window") or "hour")
    if window not in series.WINDOWS:
        raise ChartRefused(f"window: one of {', '.join(series.WINDOWS)}")
    return window


def _own_node_ids(viewer: Viewer) -> list[str] | None:
    """None (every node) for staff; a contributor's own node ids otherwise."""
    if viewer.is_staff:
        return None
    return [
        str(pk)
        for pk in Node.objects.filter(account_id=viewer.account_id).values_list("id", flat=True)
    ]


def _throughput(viewer: Viewer, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    by = str(spec.get("by") or "node")
    field = str(spec.get("field") or "tokens_per_s")
    if by not in ("model", "node", "pool") or field not in FIELDS:
        raise ChartRefused(
            "throughput: by is model, node or pool; field is one of " + ", ".join(FIELDS)
        )
    if by != "node" and not viewer.is_staff:
        raise ChartRefused("throughput: a contributor's charts are per node")
    ids: list[str] | None = None
    if by == "node":
        ids = _own_node_ids(viewer)
        if spec.get("node"):
            ids = [str(node_for(viewer, spec["node"]).id)]
    data = series.series_throughput(by=by, window=_window(spec), now=now, ids=ids)
    unit, kind = FIELDS[field]
    return {
        "x": data["x"],
        "step": data["step"],
        "unit": unit,
        "kind": kind,
        "lines": [
            {"label": ln["label"], "id": ln["id"], "values": ln[field]} for ln in data["lines"]
        ],
    }


def _ttft(viewer: Viewer, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    node_id = None
    if spec.get("node") or not viewer.is_staff:
        if not spec.get("node"):
            raise ChartRefused("ttft: a contributor's chart names one of their nodes")
        node_id = ids.node_id(node_for(viewer, spec["node"]).id)
    data = series.series_ttft(window=_window(spec), now=now, node_id=node_id)
    return {**data, "unit": "ms", "kind": "line"}


def _node_load(viewer: Viewer, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    node = node_for(viewer, str(spec.get("node") or ""))
    data = series.series_node_load(node_id=ids.node_id(node.id), window=_window(spec), now=now)
    return {**data, "unit": "", "kind": "line"}


def _layer_share(viewer: Viewer, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    data = series.series_layer_share(window=_window(spec), now=now, ids=_own_node_ids(viewer))
    return {
        "x": data["x"],
        "step": data["step"],
        "unit": "% of layers",
        "kind": "line",
        "lines": [
            {
                "label": f"{ln['label']} ({ln['share']}%)",
                "id": ln["id"],
                "values": ln["values"],
                "share": ln["share"],
            }
            for ln in data["lines"]
        ],
    }


def _earnings(viewer: Viewer, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    """Credits earned per UTC day, one line per node, from credits.selectors.node_earnings."""
    days = int(spec.get("days") or 30)
    if days not in (7, 30, 90, 366):  # the earnings page's choices
        raise ChartRefused("earnings: days is 7, 30, 90 or 366")
    node_id = None
    accounts: list[Any]
    if spec.get("node"):
        node = node_for(viewer, spec["node"])
        node_id, accounts = ids.node_id(node.id), [node.account_id]
    else:
        accounts = [str(a) for a in spec.get("accounts") or []] if viewer.is_staff else []
        accounts = accounts or [viewer.account_id]
    today = now.astimezone(UTC).date()
    xs_days = [today - timedelta(days=d) for d in range(days - 1, -1, -1)]
    index = {d: i for i, d in enumerate(xs_days)}
    lines: dict[str, dict[str, Any]] = {}
    for account_id in accounts:
        for r in credit_selectors.node_earnings(
            account_id=account_id, days=days, node_id=node_id, now=now
        ):
            i = index.get(r["day"])
            if i is None:
                continue
            line = lines.setdefault(
                r["node"],
                {"label": r["node_name"], "id": r["node"], "values": [0.0] * len(xs_days)},
            )
            line["values"][i] = round(line["values"][i] + r["credits"] / 1_000_000, 6)
    return {
        "x": [int(datetime(d.year, d.month, d.day, tzinfo=UTC).timestamp()) for d in xs_days],
        "step": 86400,
        "unit": "credits",
        "kind": "bars",
        "lines": sorted(lines.values(), key=lambda ln: str(ln["label"])),
    }


_BUILDERS = {
    "throughput": _throughput,
    "ttft": _ttft,
    "node_load": _node_load,
    "layer_share": _layer_share,
    "earnings": _earnings,
}


def chart_payload(*, viewer: Viewer, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    """One chart's payload for this viewer; ChartRefused (or Http404 for a node not theirs)."""
    build = _BUILDERS.get(str(spec.get("chart")))
    if build is None:
        raise ChartRefused(f"chart: one of {', '.join(CHARTS)}")
    return build(viewer, spec, now)


def charts_for(
    *, viewer: Viewer, specs: dict[str, dict[str, Any]], now: datetime
) -> list[dict[str, Any]]:
    """The page's charts, each ``{"id", "title", "spec", "payload"}``, in the order given."""
    out = []
    for chart_id, spec in specs.items():
        title = spec.pop("title", chart_id)
        out.append(
            {
                "id": chart_id,
                "dom_id": f"chart-data-{chart_id}",
                "title": title,
                "spec_json": json.dumps(spec),
                "payload": chart_payload(viewer=viewer, spec=spec, now=now),
            }
        )
    return out


# --- the charts each page shows -------------------------------------------------------------------


def dashboard_charts(
    *, viewer: Viewer, now: datetime, window: str = "hour"
) -> list[dict[str, Any]]:
    """Operators: throughput per model and per node, TTFT and layer shares. Contributors: their
    own nodes' throughput, layer share and earnings."""
    specs: dict[str, dict[str, Any]] = {}
    if viewer.is_staff:
        specs["tokens-model"] = {
            "title": "Tokens/s per model",
            "chart": "throughput",
            "by": "model",
            "field": "tokens_per_s",
            "window": window,
        }
        specs["requests-model"] = {
            "title": "Requests per model",
            "chart": "throughput",
            "by": "model",
            "field": "requests",
            "window": window,
        }
        specs["tokens-node"] = {
            "title": "Tokens/s per node",
            "chart": "throughput",
            "by": "node",
            "field": "tokens_per_s",
            "window": window,
        }
        specs["requests-node"] = {
            "title": "Requests per node",
            "chart": "throughput",
            "by": "node",
            "field": "requests",
            "window": window,
        }
        specs["ttft"] = {
            "title": "Time to first token (queued → first token)",
            "chart": "ttft",
            "window": window,
        }
        specs["layer-share"] = {
            "title": "Share of layers served, per node",
            "chart": "layer_share",
            "window": window,
        }
    else:
        specs["tokens-node"] = {
            "title": "Tokens/s your machines helped generate",
            "chart": "throughput",
            "by": "node",
            "field": "tokens_per_s",
            "window": window,
        }
        specs["requests-node"] = {
            "title": "Requests your machines served",
            "chart": "throughput",
            "by": "node",
            "field": "requests",
            "window": window,
        }
        specs["layer-share"] = {
            "title": "Your machines' share of the layers served",
            "chart": "layer_share",
            "window": window,
        }
    return charts_for(viewer=viewer, specs=specs, now=now)


def earnings_chart(
    *,
    viewer: Viewer,
    now: datetime,
    days: int = 30,
    accounts: list[Any] | None = None,
    node: Any = None,
) -> list[dict[str, Any]]:
    spec: dict[str, Any] = {
        "title": f"Credits earned per day, per node (last {days} days, UTC)",
        "chart": "earnings",
        "days": days,
    }
    if node is not None:
        spec["node"] = str(node)
    elif accounts:
        spec["accounts"] = [str(a) for a in accounts]
    return charts_for(viewer=viewer, specs={"earnings": spec}, now=now)


def node_charts(
    *, viewer: Viewer, node: Node, now: datetime, window: str = "hour"
) -> list[dict[str, Any]]:
    """A node's load and memory, what it served, its TTFT, and its credits per day."""
    nid = str(node.id)
    specs: dict[str, dict[str, Any]] = {
        "load": {
            "title": "CPU load and memory used",
            "chart": "node_load",
            "node": nid,
            "window": window,
        },
        "tokens-node": {
            "title": "Tokens/s it helped generate",
            "chart": "throughput",
            "by": "node",
            "node": nid,
            "field": "tokens_per_s",
            "window": window,
        },
        "requests-node": {
            "title": "Requests it served",
            "chart": "throughput",
            "by": "node",
            "node": nid,
            "field": "requests",
            "window": window,
        },
        "ttft": {
            "title": "Time to first token of its jobs",
            "chart": "ttft",
            "node": nid,
            "window": window,
        },
    }
    return charts_for(viewer=viewer, specs=specs, now=now) + earnings_chart(
        viewer=viewer, now=now, node=node.id
    )
