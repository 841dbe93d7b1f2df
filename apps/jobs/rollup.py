"""The per-minute rollup behind the web UI's charts: jobs and node telemetry as ``MinuteRollup`` rows.

Writes only here (``rollup_write``: beat every ROLLUP_PERIOD_SECONDS, and ``manage.py
rollup_flush`` for tests and operators); reads in ``apps/jobs/series.py``. A minute's job figures
are recomputed from the jobs that ended in it, so a write is idempotent and a late run (a stopped
beat) catches up on every minute since the last row, within the retention. Node telemetry (CPU
load, memory used) cannot be recomputed: it is a sample of the heartbeat hash at write time, kept
on the node's row of the minute the write ran in.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max

from agent.protocol import heartbeat_key
from apps.nodes.models import Node
from apps.nodes.states import NodeState
from racon import ids
from racon.broadcast import broadcast
from racon.ids import ModelId, NodeId
from racon.redis import get_redis

from .models import Job, JobAttempt, MinuteRollup
from .states import JOB_TERMINAL, JobState

log = logging.getLogger("racon.jobs.rollup")

POOL = "pool"
# The charts' group: the dashboard consumer re-reads its charts when a write lands.
GROUP = "nodes.dashboard"
_JOB_FIELDS = ("requests", "failed", "prompt_tokens", "completion_tokens", "layers")


def minute_floor(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0)


def model_scope(model_id: ModelId) -> str:
    return f"model:{model_id}"


def node_scope(node_id: NodeId) -> str:
    return f"node:{node_id}"


@dataclass
class _Bucket:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    layers: int = 0
    ttfts: list[float] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (p95 of 3 values is the largest)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 1)


def _layers_by_node(devices: list[dict[str, Any]]) -> dict[str, int]:
    """Layers each node held, from a plan's devices or a job's dispatch placement."""
    out: dict[str, int] = defaultdict(int)
    for d in devices or []:
        nid = str(d.get("node_id") or "")
        if not nid:
            continue
        if "layers" in d:
            start, end = d["layers"][0], d["layers"][1]
        else:
            start, end = d.get("layer_start", 0), d.get("layer_end", 0)
        out[nid] += max(0, int(end) - int(start))
    return out


def _job_shares(job: Job, attempts: list[JobAttempt]) -> list[tuple[dict[str, int], int]]:
    """(layers by node, completion tokens) per attempt: a failed-over job pays each attempt's nodes
    for the tokens that attempt produced, as settlement does; otherwise the job's own placement."""
    if attempts:
        return [
            (_layers_by_node((a.plan or {}).get("devices") or []), a.completion_tokens)
            for a in attempts
        ]
    return [(_layers_by_node((job.placement or {}).get("devices") or []), job.completion_tokens)]


def _job_buckets(start: datetime, end: datetime) -> dict[tuple[datetime, str], _Bucket]:
    jobs = list(
        Job.objects.filter(
            state__in=list(JOB_TERMINAL), finished_at__gte=start, finished_at__lt=end
        )
        .only(
            "id",
            "state",
            "model_id",
            "prompt_tokens",
            "completion_tokens",
            "placement",
            "queued_at",
            "first_token_at",
            "ttft_ms",
            "finished_at",
        )
        .prefetch_related("nodes")
    )
    attempts: dict[Any, list[JobAttempt]] = defaultdict(list)
    for a in JobAttempt.objects.filter(job_id__in=[j.id for j in jobs]).order_by("job", "number"):
        attempts[a.job_id].append(a)
    buckets: dict[tuple[datetime, str], _Bucket] = defaultdict(_Bucket)
    for job in jobs:
        assert job.finished_at is not None
        minute = minute_floor(job.finished_at)
        ttft = (
            (job.first_token_at - job.queued_at).total_seconds() * 1000
            if job.first_token_at and job.queued_at
            else job.ttft_ms
        )
        failed = job.state == JobState.FAILED
        shares = _job_shares(job, attempts.get(job.id, []))
        node_ids = {str(n.id) for n in job.nodes.all()}
        for layers, _ in shares:
            node_ids |= set(layers)
        for scope in (POOL, model_scope(ids.model_id(job.model_id))):
            b = buckets[(minute, scope)]
            b.requests += 1
            b.failed += int(failed)
            b.prompt_tokens += job.prompt_tokens
            b.completion_tokens += job.completion_tokens
            b.layers += sum(sum(layers.values()) for layers, _ in shares)
            if ttft is not None:
                b.ttfts.append(float(ttft))
        for nid in node_ids:
            b = buckets[(minute, node_scope(NodeId(nid)))]
            b.requests += 1
            b.failed += int(failed)
            # Tokens a node helped generate: every attempt it was part of. A split's tokens count
            # for each of its nodes; the layer share says how much of each token was theirs.
            b.completion_tokens += sum(t for layers, t in shares if nid in layers) or (
                job.completion_tokens if len(node_ids) == 1 else 0
            )
            b.layers += sum(layers.get(nid, 0) for layers, _ in shares)
            if ttft is not None:
                b.ttfts.append(float(ttft))
    return buckets


def _telemetry_rows(minute: datetime) -> list[MinuteRollup]:
    """A sample of each live node's load and memory, from its heartbeat hash (no DB write per
    heartbeat: this is the only place it lands in the database)."""
    nodes = list(
        Node.objects.exclude(state__in=[NodeState.OFFLINE, NodeState.UNINITIALIZED]).only(
            "id", "ram_total", "ram_available"
        )
    )
    if not nodes:
        return []
    pipe = get_redis().pipeline()
    for n in nodes:
        pipe.hget(heartbeat_key(str(n.id)), "telemetry")
    rows = []
    for n, raw in zip(nodes, pipe.execute(), strict=True):
        try:
            tele = json.loads(raw) if raw else {}
        except ValueError:
            tele = {}
        if not tele:
            continue
        available = tele.get("mem_available")
        rows.append(
            MinuteRollup(
                minute=minute,
                scope=node_scope(ids.node_id(n.id)),
                node_id=n.id,
                cpu_percent=float(tele["cpu_percent"])
                if tele.get("cpu_percent") is not None
                else None,
                mem_used_bytes=max(0, int(n.ram_total) - int(available))
                if available is not None and n.ram_total
                else None,
            )
        )
    return rows


def rollup_write(*, now: datetime, notify: bool = True) -> dict[str, int]:
    """Recompute every minute from the last rolled one (at most the retention back) up to and
    including now's, sample node telemetry into now's minute, and delete rows past the retention.
    Idempotent; returns the row counts."""
    retention = timedelta(hours=settings.ROLLUP_RETENTION_HOURS)
    current = minute_floor(now)
    horizon = minute_floor(now - retention)
    last = MinuteRollup.objects.filter(requests__gt=0).aggregate(m=Max("minute"))["m"]
    # From the last minute with jobs (its jobs may have grown since), else the whole retention.
    start = max(horizon, last) if last else horizon
    end = current + timedelta(minutes=1)
    buckets = _job_buckets(start, end)
    rows = []
    for (minute, scope), b in buckets.items():
        kind, _, ident = scope.partition(":")
        rows.append(
            MinuteRollup(
                minute=minute,
                scope=scope,
                model_id=ident if kind == "model" else None,
                node_id=ident if kind == "node" else None,
                requests=b.requests,
                failed=b.failed,
                prompt_tokens=b.prompt_tokens,
                completion_tokens=b.completion_tokens,
                layers=b.layers,
                ttft_p50_ms=_percentile(b.ttfts, 0.5),
                ttft_p95_ms=_percentile(b.ttfts, 0.95),
            )
        )
    # A node deleted since (its job rows keep no reference) has no row to hang figures on.
    live = {str(pk) for pk in Node.objects.values_list("id", flat=True)}
    rows = [r for r in rows if r.node_id is None or str(r.node_id) in live]
    telemetry = _telemetry_rows(current)
    with transaction.atomic():
        # Minutes in the window whose jobs are gone from the recount keep no stale job figures.
        MinuteRollup.objects.filter(minute__gte=start, minute__lt=end).update(
            requests=0,
            failed=0,
            prompt_tokens=0,
            completion_tokens=0,
            layers=0,
            ttft_p50_ms=None,
            ttft_p95_ms=None,
        )
        MinuteRollup.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=["minute", "scope"],
            update_fields=[*_JOB_FIELDS, "ttft_p50_ms", "ttft_p95_ms"],
        )
        MinuteRollup.objects.bulk_create(
            telemetry,
            update_conflicts=True,
            unique_fields=["minute", "scope"],
            update_fields=["cpu_percent", "mem_used_bytes"],
        )
        swept, _ = MinuteRollup.objects.filter(minute__lt=horizon).delete()
        if notify:
            transaction.on_commit(lambda: broadcast(GROUP, {"type": "rollup.written"}))
    return {
        "minutes": len({m for m, _ in buckets}),
        "rows": len(rows),
        "telemetry": len(telemetry),
        "swept": swept,
    }
