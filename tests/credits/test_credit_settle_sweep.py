"""The settle sweep: finished jobs whose settlement task was lost still get settled, once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from apps.credits.ledger import account_system, ledger_verify
from apps.credits.selectors import open_holds
from apps.credits.settlement import credit_settle_job, credit_settle_pending
from apps.credits.tasks import settle_sweep
from apps.jobs.states import JobState
from tests.support.credits import held_job, settles

pytestmark = pytest.mark.django_db


def test_a_finished_job_with_an_open_hold_and_no_settlement_is_settled_by_the_sweep_once(
    price: Any, now: Any
) -> None:
    job, consumer, owner = held_job()
    assert open_holds(account_id=consumer.pk) == 100_000 and settles(job) == 0

    later = now + timedelta(seconds=60)
    first = credit_settle_pending(now=later)
    assert [e.job_id for e in first] == [job.pk]
    assert settles(job) == 1
    assert open_holds(account_id=consumer.pk) == 0
    assert account_system(name="system:holds").balance == 0
    assert first[0].data["charged"] == 40_000  # 10 + 30 tokens, the rest of the hold released

    # Again, and the task arriving late: no second entry, no second charge.
    assert credit_settle_pending(now=later) == []
    assert credit_settle_job(job_id=job.pk, now=later).pk == first[0].pk
    assert settles(job) == 1
    assert ledger_verify().ok


def test_the_sweep_leaves_a_just_finished_job_to_its_task_and_never_settles_an_open_job(
    price: Any, now: Any
) -> None:
    finished, _, _ = held_job()
    running, consumer, _ = held_job(state=None)
    # Within the grace: the settlement task is probably on its way.
    assert credit_settle_pending(now=now, grace_seconds=3600) == []
    later = now + timedelta(seconds=60)
    assert [e.job_id for e in credit_settle_pending(now=later)] == [finished.pk]
    assert settles(running) == 0 and open_holds(account_id=consumer.pk) == 100_000


def test_failed_and_cancelled_jobs_release_their_holds_through_the_sweep_task(
    price: Any, now: Any
) -> None:
    jobs = [held_job(state=s, completion=0) for s in (JobState.FAILED, JobState.CANCELLED)]
    job_ids = {j.pk for j, _, _ in jobs}
    # The task itself (beat's entry point), with the real clock: the jobs finished "now", so move
    # their end back past the grace.
    type(jobs[0][0]).objects.filter(pk__in=job_ids).update(finished_at=now - timedelta(hours=1))
    assert settle_sweep() == 2
    assert all(open_holds(account_id=c.pk) == 0 for _, c, _ in jobs)
    assert settle_sweep() == 0
    assert ledger_verify().ok
