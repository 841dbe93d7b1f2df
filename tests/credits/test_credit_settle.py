from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from apps.accounts.models import Account
from apps.credits import signing
from apps.credits.ledger import InsufficientCredits, account_system, ledger_verify
from apps.credits.models import Entry, EntryKind, Receipt
from apps.credits.receipts import receipt_public_key
from apps.credits.rules import NodeWork, plan_work, settlement_split, token_cost
from apps.credits.settlement import JobNotTerminal, credit_reserve, credit_settle_job
from apps.credits.tasks import settle_job
from apps.jobs.states import JobState
from racon import ids
from racon.ids import JobId, NodeId
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


# --- the split (pure) ---------------------------------------------------------------------------


def test_split_follows_layers_gives_the_primary_its_bonus_and_the_rounding_remainder() -> None:
    work = [NodeWork(NodeId("a"), 7), NodeWork(NodeId("b"), 5), NodeWork("c", 3)]
    shares = settlement_split(
        value=100_001, work=work, primary_node_id="a", tokens=100, primary_share_permille=100
    )
    # bonus 10_000; the other 90_001 by 7:5:3 is 42_000.4 / 30_000.3 / 18_000.2, rounded down;
    # the 1 left over goes to the primary.
    assert shares == {"a": 10_000 + 42_000 + 1, "b": 30_000, "c": 18_000}
    assert sum(shares.values()) == 100_001


def test_split_weights_layers_by_measured_compute_time_when_reported() -> None:
    work = [
        NodeWork(NodeId("a"), 10, device_ms=2_000),
        NodeWork(NodeId("b"), 10, device_ms=6_000),
        NodeWork(NodeId("c"), 10),
    ]
    shares = settlement_split(
        value=90_000, work=work, primary_node_id="a", tokens=10, primary_share_permille=0
    )
    # c was not measured: it counts as the mean of the measured (4_000 ms), so 2:6:4.
    assert shares == {"a": 15_000, "b": 45_000, "c": 30_000}


@pytest.mark.parametrize("value", [0, 1, 7, 999_999_937])
def test_split_always_sums_exactly_and_never_goes_negative(value: int) -> None:
    work = [NodeWork(NodeId("a"), 3, 1_234), NodeWork(NodeId("b"), 1), NodeWork("c", 0)]
    shares = settlement_split(
        value=value, work=work, primary_node_id="b", tokens=3, primary_share_permille=333
    )
    assert sum(shares.values()) == value and min(shares.values()) >= 0


def test_plan_work_counts_layers_per_node_and_keeps_a_layerless_primary() -> None:
    plan = {
        "primary_node_id": "p",
        "devices": [
            {"node_id": "x", "layer_start": 0, "layer_end": 10},
            {"node_id": "y", "layer_start": 10, "layer_end": 14},
            {"node_id": "x", "layer_start": 14, "layer_end": 16},
        ],
    }
    primary, work = plan_work(plan, {"x": 1.5, "y": "bad"})
    assert primary == "p"
    assert work == [
        NodeWork(NodeId("x"), 12, 1_500),
        NodeWork(NodeId("y"), 4, None),
        NodeWork("p", 0, None),
    ]


def test_token_cost_rounds_up_to_the_micro_credit() -> None:
    assert token_cost(tokens=3, price_permille=333, micro_per_token=1) == 1
    assert token_cost(tokens=100, price_permille=1500, micro_per_token=1_000) == 150_000


# --- reserve and settle ----------------------------------------------------------------------------


def three_node_setup(*, consumer_funds: int = 1_000_000) -> dict[str, Any]:
    owners = [AccountFactory(name=f"owner-{i}") for i in range(3)]
    nodes = [NodeFactory(account=o) for o in owners]
    model = ModelFactory(price_weight_permille=1000)
    dep = deployment_for([(nodes[0], 16), (nodes[1], 8), (nodes[2], 8)], model=model)
    consumer = funded_account(consumer_funds)
    return {"owners": owners, "nodes": nodes, "model": model, "dep": dep, "consumer": consumer}


def test_reserve_then_settle_charges_tokens_used_releases_the_rest_and_pays_each_node_its_share(
    price: Any, now: Any
) -> None:
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=200)
    assert (
        credit_reserve(
            account_id=s["consumer"].pk,
            job_id=ids.job_id(job.pk),
            max_tokens=200,
            model_price_permille=1000,
            now=now,
        )
        == 200_000
    )
    assert bal(s["consumer"]) == 800_000 and account_system(name="system:holds").balance == 200_000

    job_finish(job, prompt=20, completion=80)
    entry = credit_settle_job(job_id=ids.job_id(job.pk), now=now)

    # 100 tokens × 1000 µ = 100_000: primary 10% bonus + 16/32 of the rest; the workers 8/32 each.
    assert bal(s["consumer"]) == 900_000
    assert [bal(o) for o in s["owners"]] == [55_000, 22_500, 22_500]
    assert account_system(name="system:holds").balance == 0
    assert entry.kind == EntryKind.SETTLE and entry.data["charged"] == 100_000
    receipts = {str(r.node_id): r for r in Receipt.objects.filter(job=job)}
    assert len(receipts) == 3
    pub = receipt_public_key()["public_key"]
    for node, owner in zip(s["nodes"], s["owners"], strict=True):
        r = receipts[str(node.pk)]
        assert r.account_id == owner.pk and r.credits == bal(owner)
        assert signing.receipt_verify(r.document(), pub).valid
    assert receipts[str(s["nodes"][0].pk)].payload["share_ppm"] == 550_000
    assert receipts[str(s["nodes"][1].pk)].payload["layers"] == 8
    assert ledger_verify().ok


def test_settling_the_same_job_twice_makes_exactly_one_entry(price: Any, now: Any) -> None:
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=50)
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=50,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=10)
    first = credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    again = credit_settle_job(job_id=ids.job_id(job.pk), now=timezone.now())
    assert first.pk == again.pk
    assert Entry.objects.filter(kind=EntryKind.SETTLE, job=job).count() == 1
    assert Receipt.objects.filter(job=job).count() == 3
    assert bal(s["consumer"]) == 1_000_000 - 10_000


def test_the_celery_task_settles_once_however_often_it_is_delivered(price: Any, now: Any) -> None:
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=50)
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=50,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=10)
    settle_job.delay(job_id=str(job.pk))
    settle_job.delay(job_id=str(job.pk))
    assert Entry.objects.filter(idempotency_key=f"settle:{job.pk}").count() == 1


def test_a_job_that_is_still_running_is_not_settled(price: Any, now: Any) -> None:
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"])
    with pytest.raises(JobNotTerminal):
        credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert settle_job.delay(job_id=str(job.pk)).result is None
    assert not Entry.objects.filter(kind=EntryKind.SETTLE).exists()


@pytest.mark.parametrize("state", [JobState.FAILED, JobState.CANCELLED])
def test_failed_or_cancelled_jobs_charge_only_what_was_delivered(
    price: Any, now: Any, state: str
) -> None:
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=500)
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=500,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, state=state, prompt=12, completion=3)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert bal(s["consumer"]) == 1_000_000 - 15_000
    assert sum(bal(o) for o in s["owners"]) == 15_000
    assert account_system(name="system:holds").balance == 0


def test_a_job_that_delivered_nothing_is_fully_refunded_with_zero_credit_receipts(
    price: Any, now: Any
) -> None:
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=500)
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=500,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, state=JobState.FAILED)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert bal(s["consumer"]) == 1_000_000
    assert sorted(r.credits for r in Receipt.objects.filter(job=job)) == [0, 0, 0]
    assert ledger_verify().ok


def test_usage_beyond_the_hold_is_never_charged_beyond_the_hold(price: Any, now: Any) -> None:
    # Settlement never reaches past the hold into the consumer's free balance (issue 12).
    s = three_node_setup(consumer_funds=30_000)
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=20)
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=20,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, prompt=40, completion=20)  # 60 tokens = 60_000 µ; the hold is 20_000
    entry = credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert entry.data["cost"] == 60_000 and entry.data["charged"] == 20_000
    assert entry.data["uncharged"] == 40_000
    assert bal(s["consumer"]) == 10_000  # what was free stays free
    assert sum(bal(o) for o in s["owners"]) == 20_000
    assert ledger_verify().ok


def test_a_forged_two_billion_token_usage_charges_at_most_the_hold(price: Any, now: Any) -> None:
    s = three_node_setup(consumer_funds=10_000_000)
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=100)
    held = credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=100,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=2_000_000_000)
    entry = credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert entry.data["charged"] == held == 100_000
    assert bal(s["consumer"]) == 10_000_000 - held
    assert sum(bal(o) for o in s["owners"]) == held
    assert ledger_verify().ok


def test_model_price_weight_scales_the_charge(price: Any, now: Any) -> None:
    s = three_node_setup()
    pricey = ModelFactory(price_weight_permille=2500)
    dep = deployment_for([(s["nodes"][0], 10)], model=pricey)
    job = job_for(account=s["consumer"], model=pricey, deployment=dep, max_tokens=10)
    assert (
        credit_reserve(
            account_id=s["consumer"].pk,
            job_id=ids.job_id(job.pk),
            max_tokens=10,
            model_price_permille=2500,
            now=now,
        )
        == 25_000
    )
    job_finish(job, completion=4)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert bal(s["owners"][0]) == 10_000 and bal(s["consumer"]) == 990_000


def test_a_broke_account_is_refused_a_reservation_and_nothing_is_held(price: Any, now: Any) -> None:
    s = three_node_setup(consumer_funds=999)
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=1)
    with pytest.raises(InsufficientCredits) as info:
        credit_reserve(
            account_id=s["consumer"].pk,
            job_id=ids.job_id(job.pk),
            max_tokens=1,
            model_price_permille=1000,
            now=now,
        )
    assert info.value.needed == 1_000 and info.value.available == 999
    assert bal(s["consumer"]) == 999 and account_system(name="system:holds").balance == 0


def test_the_operator_account_is_never_blocked_by_credits(price: Any, now: Any) -> None:
    s = three_node_setup()
    operator = account_system(name="system:operator")
    job = job_for(account=operator, model=s["model"], deployment=s["dep"], max_tokens=10**6)
    assert (
        credit_reserve(
            account_id=ids.account_id(operator.pk),
            job_id=ids.job_id(job.pk),
            max_tokens=10**6,
            model_price_permille=1000,
            now=now,
        )
        == 10**9
    )
    job_finish(job, completion=100)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert bal(operator) == -100_000
    assert sum(bal(o) for o in s["owners"]) == 100_000
    assert ledger_verify().ok


@pytest.mark.parametrize("max_tokens", [0, -5, 2.5])
def test_reservations_for_non_positive_token_counts_are_refused(now: Any, max_tokens: Any) -> None:
    acct = funded_account(10**6)
    with pytest.raises(ValueError):
        credit_reserve(
            account_id=ids.account_id(acct.pk),
            job_id=JobId("00000000-0000-0000-0000-000000000000"),
            max_tokens=max_tokens,
            model_price_permille=1000,
            now=now,
        )


def test_a_reservation_that_would_overflow_is_refused(now: Any) -> None:
    acct = funded_account(10**6)
    with pytest.raises(ValueError, match="overflow"):
        credit_reserve(
            account_id=ids.account_id(acct.pk),
            job_id=JobId("00000000-0000-0000-0000-000000000000"),
            max_tokens=2**40,
            model_price_permille=2**40,
            now=now,
        )


def test_a_node_owner_running_on_its_own_node_pays_and_earns_in_one_entry(
    price: Any, now: Any
) -> None:
    owner = funded_account(100_000)
    node = NodeFactory(account=owner)
    model = ModelFactory()
    dep = deployment_for([(node, 10)], model=model)
    job = job_for(account=owner, model=model, deployment=dep, max_tokens=50)
    credit_reserve(
        account_id=ids.account_id(owner.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=50,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=30)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert bal(owner) == 100_000  # paid 30_000 and earned it back
    assert ledger_verify().ok


def test_a_fee_setting_sends_its_part_to_the_fees_account(price: Any, now: Any) -> None:
    price.CREDITS_FEE_PERMILLE = 50
    s = three_node_setup()
    job = job_for(account=s["consumer"], model=s["model"], deployment=s["dep"], max_tokens=100)
    credit_reserve(
        account_id=s["consumer"].pk,
        job_id=ids.job_id(job.pk),
        max_tokens=100,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=100)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    assert account_system(name="system:fees").balance == 5_000
    assert sum(bal(o) for o in s["owners"]) == 95_000


def test_escrow_holds_a_new_contributors_earnings_until_the_trust_threshold_then_releases(
    price: Any, now: Any
) -> None:
    price.CREDITS_ESCROW_ENABLED = True
    price.CREDITS_ESCROW_TRUST_THRESHOLD = 150_000
    owner = AccountFactory()
    node = NodeFactory(account=owner)
    model = ModelFactory()
    dep = deployment_for([(node, 10)], model=model)
    consumer = funded_account(10**7)
    escrow = account_system(name="system:escrow")

    def run(tokens: int) -> None:
        job = job_for(account=consumer, model=model, deployment=dep, max_tokens=tokens)
        credit_reserve(
            account_id=ids.account_id(consumer.pk),
            job_id=ids.job_id(job.pk),
            max_tokens=tokens,
            model_price_permille=1000,
            now=now,
        )
        job_finish(job, completion=tokens)
        credit_settle_job(job_id=ids.job_id(job.pk), now=now)

    run(100)
    assert bal(owner) == 0 and bal(escrow) == 100_000
    assert Receipt.objects.get(node=node).escrowed
    run(100)  # lifetime earnings reach 200_000 ≥ 150_000: everything held is released
    assert bal(owner) == 200_000 and bal(escrow) == 0
    assert Entry.objects.filter(kind=EntryKind.ESCROW_RELEASE).count() == 1
    run(10)  # trusted now: paid directly
    assert bal(owner) == 210_000 and bal(escrow) == 0
    assert ledger_verify().ok
