"""A finished job's stream leaves its node's prefix (issue 28): deleted once the job has been
terminal for JOB_STREAM_KEEP_SECONDS, by a beat task, never on the finish path itself.

Why a grace and not the finish: the job_finished report, the relay's read of the stream's end and
a web page following the job (apps/api/consumers.py) race each other; the report can land first,
and settlement counts the stream (jobs.job_finish_from_report, streams.stream_tally). Every
follower stops at the stream's end entry or after 120 s of silence, so a stream whose job ended
longer ago than the grace (default 300 s) is followed by no one. The agent's own TTL
(STREAM_TTL_SECONDS, an hour) stays the backstop.

Each run takes the jobs that ended after the last run's mark, in order, at most _BATCH of them,
so a run's cost is bounded and a backlog drains over a few runs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings

from agent.protocol import STREAM_TTL_SECONDS, job_stream_key
from racon.redis import get_redis

from .models import Job, JobAttempt
from .states import JOB_TERMINAL

MARK_KEY = "racon:retention:streams:mark"  # epoch seconds of the last job ended that was swept
_BATCH = 2000


def job_streams_prune(*, now: datetime) -> int:
    """Delete the streams of jobs terminal for longer than JOB_STREAM_KEEP_SECONDS (each attempt's
    primary's key, and the deployment's); returns how many keys went."""
    r = get_redis()
    upto = now - timedelta(seconds=float(settings.JOB_STREAM_KEEP_SECONDS))
    floor = now - timedelta(seconds=STREAM_TTL_SECONDS + float(settings.JOB_STREAM_KEEP_SECONDS))
    mark = r.get(MARK_KEY)
    since = max(floor, datetime.fromtimestamp(float(mark), tz=now.tzinfo)) if mark else floor
    rows = list(
        Job.objects.filter(state__in=JOB_TERMINAL, finished_at__gt=since, finished_at__lte=upto)
        .order_by("finished_at")
        .values_list("pk", "deployment__primary_id", "finished_at")[:_BATCH]
    )
    if not rows:
        return 0
    primaries: dict[str, set[str]] = {str(pk): {str(p)} if p else set() for pk, p, _ in rows}
    for job_id, node_id in JobAttempt.objects.filter(
        job_id__in=[pk for pk, _, _ in rows], primary_id__isnull=False
    ).values_list("job_id", "primary_id"):
        primaries[str(job_id)].add(str(node_id))
    keys = [job_stream_key(job, node) for job, nodes in primaries.items() for node in nodes]
    gone = 0
    for i in range(0, len(keys), 500):
        gone += int(r.unlink(*keys[i : i + 500]))
    last = rows[-1][2]
    if last is not None:  # a terminal job in this query has finished_at: the filter says so
        r.set(MARK_KEY, last.timestamp(), ex=STREAM_TTL_SECONDS * 2)
    return gone
