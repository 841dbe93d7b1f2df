from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.credits.ledger import account_system
from apps.credits.rules import job_priority_order
from apps.credits.selectors import SYSTEM_STANDING, account_standing
from apps.credits.settlement import credit_reserve, credit_settle_job
from racon import ids
from tests.factories import (
    AccountFactory,
    ModelFactory,
    NodeFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)


def test_jobs_are_ordered_by_standing_then_arrival() -> None:
    now = timezone.now()
    jobs = [
        ("low-early", 10, now - timedelta(seconds=5)),
        ("high-late", 900, now - timedelta(seconds=1)),
        ("high-early", 900, now - timedelta(seconds=3)),
        ("mid", 500, now - timedelta(seconds=4)),
    ]
    assert job_priority_order(jobs, now, 30.0) == ["high-early", "high-late", "mid", "low-early"]


def test_a_job_that_waited_past_the_cap_goes_first_whatever_its_standing() -> None:
    now = timezone.now()
    jobs = [
        ("rich", 10**12, now - timedelta(seconds=1)),
        ("starved-2", 0, now - timedelta(seconds=31)),
        ("starved-1", -50, now - timedelta(seconds=45)),
    ]
    assert job_priority_order(jobs, now, 30.0) == ["starved-1", "starved-2", "rich"]


@pytest.mark.django_db
def test_standing_is_what_the_account_lent_recently_not_its_balance(price: Any, now: Any) -> None:
    contributor = funded_account(100_000)
    idle = funded_account(100_000)
    node = NodeFactory(account=contributor)
    model = ModelFactory()
    consumer = funded_account(10**6)
    job = job_for(
        account=consumer,
        model=model,
        deployment=deployment_for([(node, 4)], model=model),
        max_tokens=50,
    )
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=50,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=50)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    operator = account_system(name="system:operator")
    standing = account_standing(
        account_ids=[contributor.pk, idle.pk, str(operator.pk), AccountFactory.build().pk], now=now
    )
    values = list(standing.values())
    # Issue 28: what it earned lending in the window; the balance buys no priority.
    assert values[0] == 50_000
    assert values[1] == 0
    assert values[2] == SYSTEM_STANDING and values[3] == 0
    later = account_standing(account_ids=[contributor.pk], now=now + timedelta(days=2))
    assert later[contributor.pk] == 0  # the contribution is no longer recent
