"""Celery entry points for credits. Thin: one call into settlement each."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django.db import OperationalError
from django.utils import timezone

from racon.ids import JobId

from .settlement import (
    JobNotTerminal,
    credit_settle_batch,
    credit_settle_job,
    credit_settle_pending,
    credit_standby_reward,
)

log = logging.getLogger("racon.credits")


# acks_late: settlement is idempotent (one entry per job), so a worker lost mid-task is simply
# redelivered. OperationalError covers deadlock/serialisation aborts, which a second try fixes.
@shared_task(
    name="racon.credits.settle_job",
    acks_late=True,
    ignore_result=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
)
def settle_job(*, job_id: JobId, **kwargs: Any) -> int | None:
    """Settle one terminal job: exactly one ledger entry however often this runs."""
    try:
        return credit_settle_job(job_id=job_id, now=timezone.now()).pk
    except JobNotTerminal:
        # Enqueued on commit of the terminal transition, so this means a caller bug; retrying won't help.
        log.warning("settle_job: job %s is not terminal; not settled", job_id)
        return None


@shared_task(name="racon.credits.settle_batch", ignore_result=True)
def settle_batch(**kwargs: Any) -> int:
    """Settle the jobs whose ends queued them (apps/jobs/settle_queue.py); what a lost batch
    leaves is the sweep's."""
    return len(credit_settle_batch(now=timezone.now()))


@shared_task(name="racon.credits.standby_reward", acks_late=True, ignore_result=True)
def standby_reward(**kwargs: Any) -> int:
    """Pay READY nodes for the time they lent (idempotent per node per period)."""
    return len(credit_standby_reward(now=timezone.now()))


@shared_task(name="racon.credits.settle_sweep", ignore_result=True)
def settle_sweep(**kwargs: Any) -> int:
    """Settle finished jobs whose settlement task was lost (beat; idempotent with settle_job)."""
    return len(credit_settle_pending(now=timezone.now()))
