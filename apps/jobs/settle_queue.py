"""Finished jobs waiting for their settlement, settled in batches (issue 27).

A job's end used to send one Celery task per job (``racon.credits.settle_job``): a broker message
built and published in daphne (about 1.5 ms of its CPU a request under load, py-spy) and a task
received, run and acknowledged in the worker. Now the end adds the job's id to one Redis set and
sends ``racon.credits.settle_batch`` only when none is already on its way (a key set NX, both in
one round trip); the batch, CREDITS_SETTLE_BATCH_SECONDS later, takes every id waiting. Under
load one task settles the jobs that ended in that window; a lone job is settled as before, a
moment later.

What is lost here (a worker killed mid-batch, a Redis restart) is found by the settlement sweep
(``racon.credits.settle_sweep``, beat): it settles terminal jobs that hold credits and have no
settlement, so nothing depends on this set for correctness. Settlement is idempotent per job.
"""

from __future__ import annotations

from django.conf import settings

from racon.celery import task_send_later
from racon.ids import JobId
from racon.redis import get_redis

PENDING_KEY = "racon:settle:pending"  # SET of job ids
SCHEDULED_KEY = "racon:settle:scheduled"  # set while a batch task is on its way or running
# A batch task lost before it ran (a broker restart) leaves the key: it lapses after this, and
# the next job's end schedules a batch again (the sweep settles what waited meanwhile).
SCHEDULED_TTL_SECONDS = 60


def settle_request(*, job_id: JobId) -> None:
    """Queue a terminal job for settlement (called once its end has committed)."""
    with get_redis().pipeline(transaction=False) as pipe:
        pipe.sadd(PENDING_KEY, str(job_id))
        pipe.set(SCHEDULED_KEY, "1", nx=True, ex=SCHEDULED_TTL_SECONDS)
        _, scheduled = pipe.execute()
    if scheduled:
        _batch_send()


def settle_schedule() -> None:
    """A batch task for what waits, unless one is on its way."""
    if get_redis().set(SCHEDULED_KEY, "1", nx=True, ex=SCHEDULED_TTL_SECONDS):
        _batch_send()


def _batch_send() -> None:
    task_send_later("racon.credits.settle_batch", countdown=settings.CREDITS_SETTLE_BATCH_SECONDS)


def settle_take(*, limit: int) -> list[JobId]:
    """Up to ``limit`` queued jobs, removed from the queue."""
    return [JobId(str(j)) for j in get_redis().spop(PENDING_KEY, limit) or []]


def settle_round_end() -> bool:
    """A batch found the queue empty: drop the scheduled mark, then look once more, so that a job
    queued between the batch's last take and now (its end saw the mark and sent no task) is not
    left behind. True when jobs wait: the batch goes on."""
    r = get_redis()
    r.delete(SCHEDULED_KEY)
    return bool(r.scard(PENDING_KEY))


def settle_idle() -> bool:
    """Nothing queued for settlement and no batch on its way (benchmarks and tests wait on it)."""
    with get_redis().pipeline(transaction=False) as pipe:
        pipe.scard(PENDING_KEY)
        pipe.exists(SCHEDULED_KEY)
        pending, scheduled = pipe.execute()
    return not pending and not scheduled
