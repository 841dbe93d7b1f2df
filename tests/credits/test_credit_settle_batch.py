"""Settlement in batches (apps/jobs/settle_queue.py): a job's end queues it in Redis and sends a
batch task only when none is on its way; the batch settles every queued job, once each."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from apps.credits.ledger import ledger_verify
from apps.credits.selectors import open_holds
from apps.credits.settlement import credit_settle_batch
from apps.jobs import settle_queue
from apps.jobs.jobs import job_complete
from apps.jobs.states import JobState
from racon import ids
from racon.redis import get_redis
from tests.support.credits import held_job, settles

pytestmark = pytest.mark.django_db


def queued() -> set[str]:
    return {str(j) for j in get_redis().smembers(settle_queue.PENDING_KEY)}


def test_ends_queued_while_a_batch_is_on_its_way_wait_for_it_then_are_settled_once(
    price: Any, now: Any
) -> None:
    jobs = [held_job()[0] for _ in range(3)]
    # A batch is on its way (its mark is set): the ends queue their jobs and send nothing.
    get_redis().set(settle_queue.SCHEDULED_KEY, "1")
    for job in jobs:
        settle_queue.settle_request(job_id=ids.job_id(job.pk))
    assert queued() == {str(j.pk) for j in jobs}
    assert [settles(j) for j in jobs] == [0, 0, 0]
    entries = credit_settle_batch(now=now)
    assert sorted(str(e.job_id) for e in entries) == sorted(str(j.pk) for j in jobs)
    assert [settles(j) for j in jobs] == [1, 1, 1]
    assert queued() == set() and not get_redis().exists(settle_queue.SCHEDULED_KEY)
    # The same ids again (a late duplicate): found, not settled twice.
    for job in jobs:
        get_redis().sadd(settle_queue.PENDING_KEY, str(job.pk))
    assert len(credit_settle_batch(now=now)) == 3 and [settles(j) for j in jobs] == [1, 1, 1]
    assert ledger_verify().ok


def test_an_end_with_no_batch_on_its_way_sends_one_which_settles_it(price: Any, now: Any) -> None:
    # The suite runs Celery eager: the batch task sent here runs inline.
    job, consumer, _ = held_job()
    settle_queue.settle_request(job_id=ids.job_id(job.pk))
    assert settles(job) == 1 and open_holds(account_id=consumer.pk) == 0
    assert queued() == set() and not get_redis().exists(settle_queue.SCHEDULED_KEY)


def test_past_its_limit_a_batch_hands_the_rest_to_a_batch_of_its_own_and_skips_open_jobs(
    price: Any, now: Any
) -> None:
    done = [held_job()[0] for _ in range(3)]
    running, consumer, _ = held_job(state=None)
    r = get_redis()
    r.sadd(settle_queue.PENDING_KEY, *[str(j.pk) for j in [*done, running]])
    r.set(settle_queue.SCHEDULED_KEY, "1")
    # Eager (the suite's setting): the batch sent for the rest runs inline, within this call.
    credit_settle_batch(now=now, limit=2)
    assert [settles(j) for j in done] == [1, 1, 1]
    assert settles(running) == 0 and open_holds(account_id=consumer.pk) == 100_000
    assert queued() == set() and not r.exists(settle_queue.SCHEDULED_KEY)


@pytest.mark.django_db(transaction=True)
def test_a_job_end_through_the_jobs_api_is_settled_by_the_batch(price: Any, now: Any) -> None:
    job, consumer, _ = held_job(state=None)
    type(job).objects.filter(pk=job.pk).update(state=JobState.RUNNING)
    with transaction.atomic():  # the batch is sent once the end commits
        assert job_complete(
            job_id=ids.job_id(job.pk),
            usage={"prompt_tokens": 10, "completion_tokens": 5},
            finish_reason="stop",
            chunks=5,
            now=now,
        )
        assert settles(job) == 0
    assert settles(job) == 1 and open_holds(account_id=consumer.pk) == 0
    assert type(job).objects.get(pk=job.pk).state == JobState.COMPLETED
