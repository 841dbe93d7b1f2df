"""The stale-job sweep: close jobs that nobody will finish."""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db.models import Max

from agent.protocol import job_stream_key
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis

from . import admission, streams
from .jobs import J, job_cancel, job_complete, job_fail
from .models import Job
from .states import (
    JOB_IN_FLIGHT,
)

log = logging.getLogger("racon.jobs")


def jobs_fail_stale(*, now: datetime) -> dict[str, int]:
    """Close jobs nobody will finish: never dispatched, or silent far past the stream idle limit.

    A job whose stream already ended (the reader died after the last entry) is finished from that
    entry, so credits are settled for what was delivered and no hold stays open.
    """
    idle = float(settings.STREAM_IDLE_TIMEOUT_SECONDS) * 2
    queued_limit = (
        float(settings.DEPLOYMENT_WAIT_SECONDS) + float(settings.JOB_QUEUE_WAIT_SECONDS) + 60
    )
    r = get_redis()
    counts = {"queued": 0, "silent": 0, "finished_from_stream": 0}
    cutoff_q = now.timestamp() - queued_limit
    for job in Job.objects.filter(state=J.QUEUED).only("id", "queued_at", "deployment_id"):
        if job.queued_at.timestamp() < cutoff_q:
            if job_fail(
                job_id=ids.job_id(job.id),
                now=now,
                error="never dispatched: no capacity in time",
                during_execution=False,
            ):
                counts["queued"] += 1
    running = (
        Job.objects.filter(state__in=JOB_IN_FLIGHT)
        .select_related("deployment")
        .only("id", "dispatched_at", "queued_at", "kind", "params", "deployment__primary_id")
        .annotate(attempt=Max("attempts__number"), attempt_started=Max("attempts__started_at"))
    )
    for job in running:
        if r.exists(admission.failover_key(ids.job_id(job.id))):
            continue  # its reader is moving it to another replica
        node = (
            str(job.deployment.primary_id)
            if job.deployment is not None and job.deployment.primary_id
            else ""
        )
        last = r.xrevrange(job_stream_key(str(job.id), node), count=1) if node else []
        if last:
            entry_id, fields = last[0]
            # A failover to a replica on the same node writes the next attempt into the same
            # stream: an earlier attempt's end is not this job's end (its reader moved on).
            current = int(job.attempt or 1)  # annotated above
            try:
                earlier = int(fields.get("attempt") or 1) < current
            except ValueError:
                earlier = False
            if fields.get("type") in ("done", "error") and not earlier:
                # Billed on the controller's own count of the stream, as the follower would have.
                chunks, tokens = streams.stream_tally(ids.job_id(job.id), NodeId(node))
                usage = streams.billed_usage(
                    completion_tokens=tokens,
                    agent_usage=streams.entry_usage(fields),
                    prompt_bound=streams.prompt_token_bound(kind=job.kind, params=job.params),
                    job_id=ids.job_id(job.id),
                )
                if fields.get("type") == "done" and fields.get("finish_reason") != "cancelled":
                    done = job_complete(
                        job_id=ids.job_id(job.id),
                        usage=usage,
                        finish_reason=fields.get("finish_reason") or "stop",
                        chunks=chunks,
                        now=now,
                    )
                elif fields.get("type") == "done":
                    done = job_cancel(
                        job_id=ids.job_id(job.id),
                        now=now,
                        reason="cancelled",
                        usage=usage,
                        chunks=chunks,
                    )
                else:
                    done = job_fail(
                        job_id=ids.job_id(job.id),
                        now=now,
                        error=fields.get("text") or "failed",
                        during_execution=True,
                        usage=usage,
                        chunks=chunks,
                    )
                counts["finished_from_stream"] += int(done)
                continue
            last_ts = int(entry_id.split("-")[0]) / 1000.0
            started = job.attempt_started
            if earlier and started is not None:
                last_ts = max(last_ts, started.timestamp())
        else:
            last_ts = (job.dispatched_at or job.queued_at).timestamp()
        if now.timestamp() - last_ts > idle:
            if job_fail(
                job_id=ids.job_id(job.id),
                now=now,
                error=f"no output for {idle:.0f}s; the primary is gone",
                during_execution=True,
            ):
                counts["silent"] += 1
    return counts
