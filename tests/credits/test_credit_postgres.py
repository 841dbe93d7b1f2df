"""Real concurrency on PostgreSQL: row locks, the unique idempotency key and floors under races."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection, connections

from apps.accounts.models import Account
from apps.credits.ledger import InsufficientCredits, account_system, ledger_verify
from apps.credits.models import Entry, EntryKind, Posting, Receipt
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

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="needs PostgreSQL (set DATABASE_URL)"
    ),
]


def hammer(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(i) in n threads released at the same instant; each thread closes its own connection."""
    barrier = threading.Barrier(n)

    def run(i: int) -> Any:
        try:
            barrier.wait(timeout=30)
            return fn(i)
        except Exception as exc:  # returned, so the test can count outcomes
            return exc
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n)))


def test_fifty_concurrent_settlements_of_one_job_make_exactly_one_entry(
    price: Any, now: Any
) -> None:
    owners = [AccountFactory() for _ in range(3)]
    nodes = [NodeFactory(account=o) for o in owners]
    model = ModelFactory()
    dep = deployment_for([(nodes[0], 16), (nodes[1], 8), (nodes[2], 8)], model=model)
    consumer = funded_account(1_000_000)
    job = job_for(account=consumer, model=model, deployment=dep, max_tokens=200)
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=200,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, prompt=20, completion=80)

    results = hammer(50, lambda i: credit_settle_job(job_id=ids.job_id(job.pk), now=now))

    errors = [r for r in results if isinstance(r, Exception)]
    assert errors == []
    assert len({r.pk for r in results}) == 1
    assert Entry.objects.filter(kind=EntryKind.SETTLE, job=job).count() == 1
    assert Receipt.objects.filter(job=job).count() == 3
    assert Account.objects.get(pk=consumer.pk).balance == 900_000
    assert [Account.objects.get(pk=o.pk).balance for o in owners] == [55_000, 22_500, 22_500]
    assert ledger_verify().ok


def test_concurrent_reservations_never_take_an_account_below_its_floor(
    price: Any, now: Any
) -> None:
    consumer = funded_account(10 * 7_000 + 6_999)  # room for exactly ten 7_000 reservations
    model = ModelFactory()
    jobs = [job_for(account=consumer, model=model, max_tokens=7) for _ in range(40)]

    results = hammer(
        40,
        lambda i: credit_reserve(
            account_id=ids.account_id(consumer.pk),
            job_id=ids.job_id(jobs[i].pk),
            max_tokens=7,
            model_price_permille=1000,
            now=now,
        ),
    )

    assert sum(1 for r in results if r == 7_000) == 10
    assert sum(1 for r in results if isinstance(r, InsufficientCredits)) == 30
    assert Account.objects.get(pk=consumer.pk).balance == 6_999
    assert account_system(name="system:holds").balance == 70_000
    assert ledger_verify().ok


def test_concurrent_settlements_and_reservations_across_accounts_do_not_deadlock(
    price: Any, now: Any
) -> None:
    owners = [AccountFactory() for _ in range(3)]
    nodes = [NodeFactory(account=o) for o in owners]
    model = ModelFactory()
    # Plans listing the same nodes in different orders: lock order must not depend on plan order.
    deps = [
        deployment_for([(nodes[0], 4), (nodes[1], 4), (nodes[2], 4)], model=model),
        deployment_for([(nodes[2], 4), (nodes[1], 4), (nodes[0], 4)], model=model),
    ]
    consumers = [funded_account(10**7), owners[1]]  # one consumer also owns a node
    Account.objects.filter(pk=owners[1].pk).update(floor=-(10**7))  # let it spend without a grant
    jobs = []
    for i in range(30):
        c = consumers[i % 2]
        job = job_for(account=c, model=model, deployment=deps[i % 2], max_tokens=10)
        credit_reserve(
            account_id=ids.account_id(c.pk),
            job_id=ids.job_id(job.pk),
            max_tokens=10,
            model_price_permille=1000,
            now=now,
        )
        job_finish(job, completion=5 + i % 4)
        jobs.append(job)

    results = hammer(60, lambda i: credit_settle_job(job_id=ids.job_id(jobs[i % 30].pk), now=now))

    assert [r for r in results if isinstance(r, Exception)] == []
    assert Entry.objects.filter(kind=EntryKind.SETTLE).count() == 30
    assert Posting.objects.filter(entry__kind=EntryKind.SETTLE).exists()
    assert ledger_verify().ok
