"""A finished job's stream leaves its node's prefix (issue 28): deleted as soon as the job is
terminal and no one follows it, never while someone does.

Who follows: the /v1 relay (apps/jobs/serving.py registers it before the job is dispatched and
ends it when the request ends) and a web page following the job (apps/api/consumers.py). Each is
a member of the job's followers set with a lease (STREAM_TTL_SECONDS, the agent's own TTL), so a
follower whose process died holds nothing longer than the stream would have lived anyway. The
job's end (jobs._finish, after commit) and each follower's end both call job_stream_release,
which deletes the streams once both hold: the job is terminal and its followers set is empty.
Settlement counts the stream (jobs.job_finish_from_report, streams.stream_tally) before the
finish, so nothing reads a deleted stream it needed.

The beat task (job_streams_prune) is the backstop for a release that never ran (a controller
restart between the finish and its after-commit): it takes the jobs terminal for longer than
JOB_STREAM_KEEP_SECONDS, followed by no one. Each run takes the jobs that ended after the last
run's mark, in order, at most _BATCH of them, so a run's cost is bounded and a backlog drains
over a few runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings

from agent.protocol import STREAM_TTL_SECONDS, job_stream_key
from racon import ids
from racon.ids import JobId, NodeId
from racon.redis import get_redis

from .models import Job, JobAttempt
from .states import JOB_TERMINAL

ARCHIVE_PREFIX = "racon:archive:"  # + a node's stream key: the owner's replay copy
MARK_KEY = "racon:retention:streams:mark"  # epoch seconds of the last job ended that was swept
FOLLOWERS_KEY = "racon:streams:followers:{job}"  # ZSET: follower token -> lease end (epoch s)
_BATCH = 2000


def _followers_key(job_id: JobId) -> str:
    return FOLLOWERS_KEY.format(job=str(job_id))


def stream_archive_key(key: str) -> str:
    """Where a released stream's replay copy lives: outside every node's prefix, so the node that
    wrote it can neither read, grow nor keep it; it expires STREAM_TTL_SECONDS after the job's end
    (the job page's "kept for an hour")."""
    return ARCHIVE_PREFIX + key


def job_stream_entries(
    *, job_id: JobId, node_id: NodeId | None = None
) -> list[tuple[str, dict[str, str]]]:
    """A job's stream entries, wherever they are now: a node's own key while it is there, the
    controller's copy (stream_archive_key) once job_stream_release moved it. From ``node_id``'s
    stream, or else from every primary the job had (each attempt's); [] when none is left. The one
    reader of a finished job's entries (the job page's live watcher picks its key the same way, in
    apps.jobs.streams)."""
    if node_id is not None:
        keys = [job_stream_key(str(job_id), str(node_id))]
    else:
        keys = _stream_keys(
            list(Job.objects.filter(pk=job_id).values_list("pk", "deployment__primary_id"))
        )
    r = get_redis()
    entries: list[tuple[str, dict[str, str]]] = []
    for key in keys:
        entries += r.xrange(key) or r.xrange(stream_archive_key(key))
    return entries


def stream_follow_begin(*, job_id: JobId) -> str:
    """Register a follower of the job's stream; the token ends it (stream_follow_end)."""
    token = uuid.uuid4().hex
    key = _followers_key(job_id)
    pipe = get_redis().pipeline()
    pipe.zadd(key, {token: time.time() + STREAM_TTL_SECONDS})
    pipe.expire(key, STREAM_TTL_SECONDS)
    pipe.execute()
    return token


def stream_follow_end(*, job_id: JobId, token: str, ended_on: Iterable[Any] | None = None) -> int:
    """End a follower; the job's streams go if it is terminal and no one else follows.

    ``ended_on``: the caller has just recorded the job's end and knows the primaries its
    attempts ran on (the /v1 relay: its follower saw every attempt). Then nothing is read from
    the database, and the follower's end and the check for others take one round trip; a key it
    missed is left to job_streams_prune."""
    if ended_on is None:
        get_redis().zrem(_followers_key(job_id), token)
        return job_stream_release(job_id=job_id)
    if stream_followed(job_id, leaving=token):
        return 0
    return _streams_archive(
        [job_stream_key(job_id, node) for node in sorted({*map(str, ended_on)})]
    )


def stream_followed(job_id: JobId, *, leaving: str | None = None) -> bool:
    """Whether anyone follows the job's stream now (expired leases dropped); ``leaving``: a
    follower's token, ended in the same round trip."""
    key = _followers_key(job_id)
    pipe = get_redis().pipeline()
    if leaving is not None:
        pipe.zrem(key, leaving)
    pipe.zremrangebyscore(key, "-inf", time.time())
    pipe.zcard(key)
    return int(pipe.execute()[-1]) > 0


def _stream_keys(rows: list[tuple[Any, Any]]) -> list[str]:
    """Every stream key of these (job id, deployment primary) rows: each attempt's primary's."""
    primaries: dict[str, set[str]] = {str(pk): {str(p)} if p else set() for pk, p in rows}
    for job_id, node_id in JobAttempt.objects.filter(
        job_id__in=[pk for pk, _ in rows], primary_id__isnull=False
    ).values_list("job_id", "primary_id"):
        primaries[str(job_id)].add(str(node_id))
    return [job_stream_key(job, node) for job, nodes in primaries.items() for node in nodes]


def job_stream_release(*, job_id: JobId) -> int:
    """Delete the job's streams if it is terminal and followed by no one; returns keys deleted."""
    if stream_followed(job_id):
        return 0
    rows = list(
        Job.objects.filter(pk=job_id, state__in=JOB_TERMINAL).values_list(
            "pk", "deployment__primary_id"
        )
    )
    if not rows:
        return 0
    return _streams_archive(_stream_keys(rows))


def _streams_archive(keys: list[str]) -> int:
    """Delete a terminal job's stream keys, each kept as the controller's archived copy."""
    if not keys:
        return 0
    # The node's copy goes; the owner's job page replays a controller-owned copy for an hour.
    pipe = get_redis().pipeline()
    for key in keys:
        pipe.copy(key, stream_archive_key(key), replace=True)
        pipe.expire(stream_archive_key(key), STREAM_TTL_SECONDS)
    pipe.unlink(*keys)
    return int(pipe.execute()[-1])


def job_streams_prune(*, now: datetime) -> int:
    """Delete the streams of jobs terminal for longer than JOB_STREAM_KEEP_SECONDS and followed by
    no one (each attempt's primary's key, and the deployment's); returns how many keys went. The
    backstop: job_stream_release deletes them at the job's end."""
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
    keys = _stream_keys([(pk, p) for pk, p, _ in rows if not stream_followed(ids.job_id(pk))])
    gone = 0
    for i in range(0, len(keys), 500):
        gone += int(r.unlink(*keys[i : i + 500]))
    last = rows[-1][2]
    if last is not None:  # a terminal job in this query has finished_at: the filter says so
        r.set(MARK_KEY, last.timestamp(), ex=STREAM_TTL_SECONDS * 2)
    return gone
