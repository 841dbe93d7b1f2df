"""Chart series read from the per-minute rollup (``apps/jobs/rollup.py``): one selector per series.

Every series has the same shape, ready for uPlot: ``x`` (step starts, Unix seconds, oldest first,
with no gaps: a step without rows is 0 or None), ``step`` (seconds) and ``lines`` (one per model or
node, each with a ``label`` and its value arrays). The hour is read per minute, the day per ten
minutes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Avg, Count, Sum

from racon.ids import ModelId, NodeId

from .models import Job, MinuteRollup
from .rollup import POOL, minute_floor
from .states import JobState

WINDOWS: dict[str, tuple[timedelta, int]] = {
    "hour": (timedelta(hours=1), 60),
    "day": (timedelta(days=1), 600),
}


def _axis(window: str, now: datetime) -> tuple[datetime, int, list[int]]:
    span, step = WINDOWS.get(window, WINDOWS["hour"])
    end = int(minute_floor(now).timestamp()) // step * step
    start = end - int(span.total_seconds()) + step
    return datetime.fromtimestamp(start, tz=now.tzinfo), step, list(range(start, end + 1, step))


def _rows(scopes: Iterable[str] | None, prefix: str, since: datetime) -> Any:
    qs = MinuteRollup.objects.filter(minute__gte=since)
    if scopes is not None:
        qs = qs.filter(scope__in=list(scopes))
    else:
        qs = qs.filter(scope__startswith=prefix)
    return qs.values(
        "minute",
        "scope",
        "model__name",
        "node__name",
        "requests",
        "failed",
        "completion_tokens",
        "layers",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "cpu_percent",
        "mem_used_bytes",
    )


def _index(xs: list[int], step: int, minute: datetime) -> int:
    return (int(minute.timestamp()) // step * step - xs[0]) // step


def _label(row: dict[str, Any]) -> str:
    if row["scope"] == POOL:
        return "all"
    return row["model__name"] or row["node__name"] or row["scope"]


def series_throughput(
    *, by: str, window: str, now: datetime, ids: Iterable[Any] | None = None
) -> dict[str, Any]:
    """Requests, failures, completion tokens and tokens/s per step: one line per model (``by=
    "model"``), per node (``"node"``) or for the whole pool (``"pool"``); ``ids`` limits the lines."""
    since, step, xs = _axis(window, now)
    scopes = [POOL] if by == "pool" else None if ids is None else [f"{by}:{i}" for i in ids]
    lines: dict[str, dict[str, Any]] = {}
    for row in _rows(scopes, f"{by}:", since):
        line = lines.setdefault(
            row["scope"],
            {
                "id": row["scope"].partition(":")[2] or POOL,
                "label": _label(row),
                "requests": [0] * len(xs),
                "failed": [0] * len(xs),
                "tokens": [0] * len(xs),
            },
        )
        i = _index(xs, step, row["minute"])
        if 0 <= i < len(xs):
            line["requests"][i] += row["requests"]
            line["failed"][i] += row["failed"]
            line["tokens"][i] += row["completion_tokens"]
    out = sorted(lines.values(), key=lambda ln: ln["label"])
    for line in out:
        line["tokens_per_s"] = [round(t / step, 3) for t in line["tokens"]]
        line["total_requests"] = sum(line["requests"])
        line["total_tokens"] = sum(line["tokens"])
    return {"x": xs, "step": step, "window": window, "lines": out}


def series_ttft(
    *, window: str, now: datetime, model_id: ModelId | None = None, node_id: NodeId | None = None
) -> dict[str, Any]:
    """Time to first token (queued → first token), p50 and p95 per step, for the pool, a model or
    the jobs a node took part in. A ten-minute step shows the request-weighted mean of its
    minutes' p50 and their largest p95."""
    since, step, xs = _axis(window, now)
    scope = f"node:{node_id}" if node_id else f"model:{model_id}" if model_id else POOL
    p50w: list[float] = [0.0] * len(xs)
    weight = [0] * len(xs)
    p95: list[float | None] = [None] * len(xs)
    for row in _rows([scope], "", since):
        i = _index(xs, step, row["minute"])
        if not 0 <= i < len(xs) or row["ttft_p50_ms"] is None:
            continue
        n = max(1, row["requests"])
        p50w[i] += row["ttft_p50_ms"] * n
        weight[i] += n
        p95[i] = max(p95[i] or 0.0, row["ttft_p95_ms"] or 0.0)
    p50 = [round(p50w[i] / weight[i], 1) if weight[i] else None for i in range(len(xs))]
    return {
        "x": xs,
        "step": step,
        "window": window,
        "lines": [{"label": "p50", "values": p50}, {"label": "p95", "values": p95}],
    }


def series_node_load(*, node_id: NodeId, window: str, now: datetime) -> dict[str, Any]:
    """A node's CPU load (percent) and memory used (bytes) per step, from the telemetry samples."""
    since, step, xs = _axis(window, now)
    cpu: dict[int, list[float]] = defaultdict(list)
    mem: dict[int, list[int]] = defaultdict(list)
    for row in _rows([f"node:{node_id}"], "", since):
        i = _index(xs, step, row["minute"])
        if not 0 <= i < len(xs):
            continue
        if row["cpu_percent"] is not None:
            cpu[i].append(row["cpu_percent"])
        if row["mem_used_bytes"] is not None:
            mem[i].append(row["mem_used_bytes"])
    return {
        "x": xs,
        "step": step,
        "window": window,
        "lines": [
            {
                "label": "CPU load %",
                "values": [
                    round(sum(cpu[i]) / len(cpu[i]), 1) if cpu[i] else None for i in range(len(xs))
                ],
            },
            {
                "label": "memory used (GiB)",
                "values": [
                    round(sum(mem[i]) / len(mem[i]) / 2**30, 2) if mem[i] else None
                    for i in range(len(xs))
                ],
            },
        ],
    }


def series_layer_share(
    *, window: str, now: datetime, ids: Iterable[Any] | None = None
) -> dict[str, Any]:
    """Each node's share (percent) of the layers that served the pool's jobs per step, and over
    the whole window (``share``): a node holding 20 of a 30-layer split's layers served 67%."""
    since, step, xs = _axis(window, now)
    pool = [0] * len(xs)
    for row in _rows([POOL], "", since):
        i = _index(xs, step, row["minute"])
        if 0 <= i < len(xs):
            pool[i] += row["layers"]
    lines: dict[str, dict[str, Any]] = {}
    scopes = None if ids is None else [f"node:{i}" for i in ids]
    for row in _rows(scopes, "node:", since):
        i = _index(xs, step, row["minute"])
        if not 0 <= i < len(xs):
            continue
        line = lines.setdefault(
            row["scope"],
            {"id": row["scope"].partition(":")[2], "label": _label(row), "layers": [0] * len(xs)},
        )
        line["layers"][i] += row["layers"]
    total = sum(pool)
    out = sorted(lines.values(), key=lambda ln: ln["label"])
    for line in out:
        line["values"] = [
            round(100 * line["layers"][i] / pool[i], 1) if pool[i] else None for i in range(len(xs))
        ]
        line["share"] = round(100 * sum(line["layers"]) / total, 1) if total else 0.0
    return {"x": xs, "step": step, "window": window, "lines": out}


def deployment_measured_tps(*, deployment_ids: Iterable[Any], since: datetime) -> dict[str, float]:
    """Measured tokens/s per deployment: the mean of its completed jobs' own rates since ``since``."""
    rows = (
        Job.objects.filter(
            deployment_id__in=list(deployment_ids),
            state=JobState.COMPLETED,
            finished_at__gte=since,
            tokens_per_s__isnull=False,
        )
        .values("deployment_id")
        .annotate(rate=Avg("tokens_per_s"), n=Count("id"))
        .order_by()
    )
    return {str(r["deployment_id"]): round(float(r["rate"]), 1) for r in rows}


def node_served(
    *, node_ids: Iterable[Any], since: datetime | None = None
) -> dict[str, dict[str, Any]]:
    """What each node served: jobs it took part in, their completion tokens, and the models, since
    ``since`` (None: ever)."""
    ids = [str(i) for i in node_ids]
    out: dict[str, dict[str, Any]] = {i: {"jobs": 0, "tokens": 0, "models": []} for i in ids}
    through = Job.nodes.through.objects.filter(node_id__in=ids)
    if since is not None:
        through = through.filter(job__finished_at__gte=since)
    for r in (
        through.values("node_id", "job__model__name")
        .annotate(jobs=Count("job_id", distinct=True), tokens=Sum("job__completion_tokens"))
        .order_by("job__model__name")
    ):
        got = out[str(r["node_id"])]
        got["jobs"] += int(r["jobs"])
        got["tokens"] += int(r["tokens"] or 0)
        got["models"].append(r["job__model__name"])
    return out
