"""Failover bookkeeping without agents: the credit split across attempts, a superseded attempt's
late job_finished, and routing that skips a deployment marked dead at once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.utils import timezone

from apps.accounts.models import Account
from apps.credits.ledger import account_system, ledger_verify
from apps.credits.models import Receipt
from apps.credits.settlement import attempts_split, credit_reserve, credit_settle_job
from apps.jobs import admission, selectors
from apps.jobs.jobs import job_finish_from_report
from apps.jobs.models import JobAttempt
from apps.jobs.states import JobState
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

pytestmark = pytest.mark.django_db


def bal(acct: Account) -> int:
    return Account.objects.get(pk=acct.pk).balance


def two_replicas() -> dict[str, Any]:
    owners = [AccountFactory(name=f"fo-owner-{i}") for i in range(2)]
    nodes = [NodeFactory(account=o) for o in owners]
    model = ModelFactory(price_weight_permille=1000)
    deps = [deployment_for([(n, 30)], model=model) for n in nodes]
    return {
        "owners": owners,
        "nodes": nodes,
        "model": model,
        "deps": deps,
        "consumer": funded_account(1_000_000),
    }


def failed_over_job(
    s: dict[str, Any], *, first: int, second: int, prompt: int, max_tokens: int = 200
) -> Any:
    job = job_for(
        account=s["consumer"], model=s["model"], deployment=s["deps"][1], max_tokens=max_tokens
    )
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=max_tokens,
        model_price_permille=1000,
        now=timezone.now(),
    )
    now = timezone.now()
    for number, (dep, tokens) in enumerate(zip(s["deps"], (first, second), strict=True), start=1):
        JobAttempt.objects.create(
            job=job,
            number=number,
            deployment=dep,
            primary=dep.primary,
            plan=dep.plan,
            started_at=now,
            ended_at=now,
            completion_tokens=tokens,
            outcome="X",
        )
    return job_finish(job, prompt=prompt, completion=first + second)


def test_attempts_split_is_exact_and_proportional() -> None:
    assert attempts_split(value=100, weights=[30, 70]) == [30, 70]
    assert sum(attempts_split(value=1_000_003, weights=[7, 0, 5])) == 1_000_003
    assert attempts_split(value=10, weights=[0, 0]) == [0, 10]


def test_settlement_pays_each_attempts_primary_for_what_it_produced_and_charges_once(
    price: Any, now: Any
) -> None:
    s = two_replicas()
    job = failed_over_job(s, first=30, second=50, prompt=20)
    entry = credit_settle_job(job_id=job.pk, now=now)
    # 100 tokens charged once (prompt 20 + 30 + 50), never the 130 the two attempts evaluated.
    assert entry.data["charged"] == 100_000 and bal(s["consumer"]) == 900_000
    # Attempt 1: prompt + its 30 tokens; attempt 2: its 50. No fee in the test settings.
    paid = [bal(o) for o in s["owners"]]
    assert sum(paid) == 100_000 - entry.data["fee"]
    assert paid[0] == pytest.approx(paid[1], rel=0.02)  # equal weights: 20 + 30 against 50
    receipts = {str(r.node_id): r for r in Receipt.objects.filter(job=job)}
    assert set(receipts) == {str(n.pk) for n in s["nodes"]} and all(
        r.is_primary for r in receipts.values()
    )
    assert [a["tokens"] for a in entry.data["attempts"]] == [50, 50]
    assert account_system(name="system:holds").balance == 0
    assert ledger_verify().ok


def test_a_node_is_never_paid_for_tokens_it_did_not_produce(price: Any, now: Any) -> None:
    s = two_replicas()
    job = failed_over_job(s, first=0, second=40, prompt=0)  # attempt 1 died before any token
    credit_settle_job(job_id=job.pk, now=now)
    assert bal(s["owners"][0]) == 0 and bal(s["owners"][1]) > 0


def test_job_finished_of_a_superseded_attempt_is_stale(caplog: pytest.LogCaptureFixture) -> None:
    s = two_replicas()
    job = job_for(account=None, model=s["model"], deployment=s["deps"][1])
    job.state = JobState.RUNNING
    job.save(update_fields=["state"])
    now = timezone.now()
    JobAttempt.objects.create(
        job=job,
        number=1,
        deployment=s["deps"][0],
        primary=s["nodes"][0],
        started_at=now,
        ended_at=now,
        completion_tokens=12,
        outcome="PRIMARY_DIED",
    )
    JobAttempt.objects.create(
        job=job, number=2, deployment=s["deps"][1], primary=s["nodes"][1], started_at=now
    )
    with caplog.at_level(logging.INFO, logger="racon.jobs"):
        job_finish_from_report(
            node_id=s["nodes"][0].pk,
            payload={
                "job_id": str(job.pk),
                "status": "failed",
                "attempt": 1,
                "error": "the primary process exited",
                "completion_tokens": 12,
            },
            now=now,
        )
    job.refresh_from_db()
    assert job.state == JobState.RUNNING  # not failed, not settled: attempt 2 runs
    assert "superseded attempt 1" in caplog.text


def test_routing_skips_a_deployment_marked_dead_at_once(settings: Any) -> None:
    s = two_replicas()
    dead, live = s["deps"]
    admission.deployment_mark_dead(deployment_id=dead.id, seconds=30)
    for _ in range(5):
        got = selectors.deployment_route(model_id=s["model"].id)
        assert got is not None and got.id == live.id
    assert selectors.deployment_route(model_id=s["model"].id, exclude=[live.id]) is None
