"""Domain metrics recorded in Redis at event time, read at scrape time (correct across processes)."""

from __future__ import annotations

import logging
from typing import Any

from racon.redis import get_redis

log = logging.getLogger("racon.metrics")

# Histogram buckets (seconds for TTFT, tokens/s for throughput).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)


def job_finished_observe(*, job_id: Any, state: str, fields: dict[str, Any]) -> None:
    """Count a finished job and observe its TTFT and tokens/s (never fails the caller)."""
    try:
        from apps.jobs.models import Job  # noqa: PLC0415

        model = Job.objects.filter(pk=job_id).values_list("model__name", flat=True).first() or "unknown"
        r = get_redis()
        with r.pipeline(transaction=False) as pipe:
            pipe.hincrby("racon:metrics:jobs_finished", f"{model}|{state}", 1)
            tokens = int(fields.get("completion_tokens") or 0)
            if tokens:
                pipe.hincrby("racon:metrics:tokens", model, tokens)
            ttft = fields.get("ttft_ms")
            if ttft is not None:
                _observe(pipe, "ttft", model, float(ttft) / 1000.0, TTFT_BUCKETS)
            tps = fields.get("tokens_per_s")
            if tps is not None:
                _observe(pipe, "tps", model, float(tps), TPS_BUCKETS)
            pipe.execute()
    except Exception:  # noqa: BLE001 - metrics must never break a job's finish
        log.warning("could not record job metrics", exc_info=True)


def _observe(pipe: Any, name: str, label: str, value: float, buckets: tuple[float, ...]) -> None:
    key = f"racon:metrics:hist:{name}"
    for b in buckets:
        if value <= b:
            pipe.hincrby(key, f"{label}|{b}", 1)
    pipe.hincrby(key, f"{label}|+Inf", 1)
    pipe.hincrbyfloat(key, f"{label}|sum", value)
