"""Property test: random sequences of jobs, failures, retries, grants and standby keep the ledger sound."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from apps.accounts.models import Account
from apps.credits.ledger import (
    InsufficientCredits,
    account_system,
    credit_adjust,
    credit_grant,
    ledger_verify,
)
from apps.credits.models import Entry, Posting
from apps.credits.settlement import credit_reserve, credit_settle_job, credit_standby_reward
from apps.jobs.models import Job
from apps.jobs.states import JobState
from racon import ids
from tests.factories import (
    AccountFactory,
    ModelFactory,
    NodeFactory,
    deployment_for,
    job_finish,
    job_for,
)

pytestmark = pytest.mark.django_db
GIB = 1024**3
T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)

account_idx = st.integers(0, 3)  # 0-2: users (one poor), 3: the operator
finish = st.tuples(
    st.sampled_from([JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED]),
    st.integers(0, 400),
    st.integers(0, 900),
    st.booleans(),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("job"), account_idx, st.integers(1, 800), st.booleans(), finish),
        st.tuples(st.just("finish"), st.integers(0, 40), finish),
        st.tuples(st.just("resettle"), st.integers(0, 40)),
        st.tuples(st.just("grant"), account_idx, st.integers(1, 2_000_000)),
        st.tuples(st.just("adjust"), account_idx, st.integers(-2_000_000, 2_000_000).filter(bool)),
        st.tuples(st.just("standby"), st.integers(1, 30)),
    ),
    max_size=30,
)
config = st.fixed_dictionaries(
    {
        "escrow": st.booleans(),
        "threshold": st.integers(0, 300_000),
        "primary_permille": st.integers(0, 1000),
        "fee_permille": st.integers(0, 200),
        "price": st.integers(0, 3000),
        "micro": st.integers(1, 2_000),
    }
)


def check_invariants(*, minted: int, open_holds: int) -> None:
    report = ledger_verify()
    # 1. every entry's postings sum to zero
    assert report.unbalanced_entries == []
    # 2. the replay of the postings equals every cached balance
    assert report.balance_mismatches == []
    # 3. no balance below its floor
    assert report.below_floor == []
    for acct in Account.objects.exclude(floor=None):
        assert acct.balance >= acct.floor, acct.name
    # 4. the total minted equals the sum of the balances of every other account
    mint = account_system(name="system:mint")
    non_mint = sum(Account.objects.exclude(pk=mint.pk).values_list("balance", flat=True))
    assert -mint.balance == minted == non_mint == report.total_minted
    # and the holds account holds exactly the reservations not settled yet
    assert account_system(name="system:holds").balance == open_holds
    assert report.holds_mismatch is None


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cfg=config, steps=ops)
def test_random_jobs_failures_retries_and_grants_keep_the_ledger_sound(
    cfg: dict[str, Any], steps: list[tuple[Any, ...]]
) -> None:
    with (
        override_settings(
            CREDITS_ESCROW_ENABLED=cfg["escrow"],
            CREDITS_ESCROW_TRUST_THRESHOLD=cfg["threshold"],
            CREDITS_PRIMARY_SHARE_PERMILLE=cfg["primary_permille"],
            CREDITS_FEE_PERMILLE=cfg["fee_permille"],
            CREDITS_MICRO_PER_TOKEN=cfg["micro"],
            CREDITS_STANDBY_PER_GIB_HOUR=1_000,
            CREDITS_STANDBY_PERIOD_SECONDS=600,
        ),
        transaction.atomic(),
    ):
        run_steps(cfg, steps)
        transaction.set_rollback(True)  # each example starts from an empty ledger


def run_steps(cfg: dict[str, Any], steps: list[tuple[Any, ...]]) -> None:
    now = T0
    mint = account_system(name="system:mint")
    minted = -mint.balance
    users = [AccountFactory(), AccountFactory(), AccountFactory()]
    accounts = [*users, account_system(name="system:operator")]
    for acct, funds in zip(users, (5_000_000, 2_000_000, 3_000), strict=True):
        credit_grant(account_id=ids.account_id(acct.pk), amount=funds, reason="seed", now=now)
        minted += funds
    owners = [AccountFactory(), AccountFactory(), users[0]]  # one consumer also lends a node
    nodes = [
        NodeFactory(
            account=o,
            ram_available=(i + 1) * GIB,
            vram_free=i * GIB,
            state_changed_at=now - timedelta(hours=1),
        )
        for i, o in enumerate(owners)
    ]
    model = ModelFactory(price_weight_permille=cfg["price"])
    dep = deployment_for(
        [(nodes[0], 13), (nodes[1], 7), (nodes[2], 5)], model=model, primary=nodes[1]
    )
    pending: list[Job] = []
    held: dict[Any, int] = {}  # job id → amount still held
    settled: list[Any] = []

    def settle(job: Job, outcome: tuple[Any, ...]) -> None:
        state, prompt, completion, measured = outcome
        seconds = {str(n.pk): 0.1 * (i + 1) for i, n in enumerate(nodes[:2])} if measured else None
        job_finish(job, state=state, prompt=prompt, completion=completion, device_seconds=seconds)
        entry = credit_settle_job(job_id=ids.job_id(job.pk), now=now)
        pending.remove(job)
        settled.append(job.pk)
        hold = held.pop(job.pk)
        charged = entry.data["charged"]
        assert 0 <= charged <= entry.data["cost"] and entry.data["held"] == hold
        # the consumer gets back exactly the hold less the charge (its own earnings are separate legs)
        assert job.account_id is not None
        refund = entry.postings.filter(account_id=job.account_id, beneficiary__isnull=True)
        assert sum(p.amount for p in refund) == hold - charged
        paid = sum(p.amount for p in entry.postings.filter(beneficiary__isnull=False))
        assert (
            paid + entry.data["fee"] == charged
        )  # what the consumer paid is exactly what was paid out
        assert Job.objects.get(pk=job.pk).receipts.count() == 3

    for step in steps:
        op = step[0]
        if op == "job":
            _, idx, max_tokens, settle_now, outcome = step
            acct = accounts[idx]
            try:
                with transaction.atomic():
                    job = job_for(
                        account=acct,
                        model=model,
                        deployment=dep,
                        max_tokens=max_tokens,
                        queued_at=now,
                    )
                    held[job.pk] = credit_reserve(
                        account_id=acct.pk,
                        job_id=ids.job_id(job.pk),
                        max_tokens=max_tokens,
                        model_price_permille=cfg["price"],
                        now=now,
                    )
                pending.append(job)
            except InsufficientCredits:
                assert acct.name != "system:operator", "the operator must never be blocked"
                continue
            if settle_now:
                check_invariants(minted=minted, open_holds=sum(held.values()))
                settle(job, outcome)
        elif op == "finish" and pending:
            settle(pending[step[1] % len(pending)], step[2])
        elif op == "resettle" and settled:
            job_id = settled[step[1] % len(settled)]
            entries, postings = Entry.objects.count(), Posting.objects.count()
            first = Entry.objects.get(idempotency_key=f"settle:{job_id}")
            assert credit_settle_job(job_id=job_id, now=now).pk == first.pk
            assert (Entry.objects.count(), Posting.objects.count()) == (entries, postings)
        elif op == "grant":
            credit_grant(account_id=accounts[step[1]].pk, amount=step[2], reason="prop", now=now)
            minted += step[2]
        elif op == "adjust":
            before = Account.objects.get(pk=accounts[step[1]].pk).balance
            try:
                credit_adjust(
                    account_id=accounts[step[1]].pk, amount=step[2], reason="prop", now=now
                )
                minted += step[2]
            except InsufficientCredits:
                assert step[2] < 0 and before + step[2] < 0
        elif op == "standby":
            now += timedelta(minutes=step[1])
            for entry in credit_standby_reward(now=now):
                minted += -sum(p.amount for p in entry.postings.filter(account=mint))
        check_invariants(minted=minted, open_holds=sum(held.values()))
    for job in list(pending):  # every job ends: nothing may stay held
        settle(job, (JobState.CANCELLED, 0, 1, False))
    check_invariants(minted=minted, open_holds=0)
    event(f"settled {min(len(settled), 5)}+ jobs")
    event(
        "escrow used"
        if Account.objects.get(name="system:escrow").postings.exists()
        else "escrow unused"
    )
