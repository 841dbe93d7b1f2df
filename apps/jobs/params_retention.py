"""Retention of finished jobs' prompts (issue 28): what a user sent is kept only so long.

A job's ``params`` hold the request as sent: the messages or prompt, tools, stop strings, a JSON
schema. Once the job has been terminal for JOB_PARAMS_RETENTION_DAYS (README's settings table;
0 keeps them), the sweep (beat, hourly) keeps only the numeric and boolean sampling settings
(temperature, top_p, seed, …) and records which keys it removed and when. Usage, timings,
billing and receipts are untouched: they never held the text.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q

from .models import Job
from .states import JOB_TERMINAL

log = logging.getLogger("racon.jobs.retention")

REMOVED_KEY = "_removed"
BATCH = 500


def params_redacted(params: dict[str, Any], *, now: datetime) -> dict[str, Any]:
    """The params without anything a user wrote: numbers and booleans stay, the rest is named."""
    kept: dict[str, Any] = {
        k: v
        for k, v in params.items()
        if k != REMOVED_KEY and isinstance(v, (int, float, bool)) and v is not None
    }
    removed = sorted(k for k in params if k not in kept and k != REMOVED_KEY)
    kept[REMOVED_KEY] = {"keys": removed, "at": now.isoformat()}
    return kept


def job_params_sweep(*, now: datetime, batch: int = BATCH) -> int:
    """Redact the params of jobs terminal for longer than the retention; returns how many."""
    days = int(settings.JOB_PARAMS_RETENTION_DAYS)
    if days <= 0:
        return 0
    cutoff = now - timedelta(days=days)
    done = 0
    while True:
        jobs = list(
            Job.objects.filter(state__in=list(JOB_TERMINAL))
            .filter(Q(finished_at__lt=cutoff) | Q(finished_at__isnull=True, queued_at__lt=cutoff))
            .exclude(params={})
            .exclude(params__has_key=REMOVED_KEY)
            .only("id", "params")
            .order_by("queued_at")[:batch]
        )
        if not jobs:
            break
        for job in jobs:
            job.params = params_redacted(
                job.params if isinstance(job.params, dict) else {}, now=now
            )
        Job.objects.bulk_update(jobs, ["params"])
        done += len(jobs)
        if len(jobs) < batch:
            break
    if done:
        log.info("params retention: removed the prompts of %d finished job(s)", done)
    return done
