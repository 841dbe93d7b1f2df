"""Job settlement, holds (reservations) and standby pay, all posted through ledger.ledger_post.

Locks follow the ledger's one order (ledger.accounts_lock: every account in primary-key order,
in one query) before any entry is written; see the top of ledger.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q, Sum

from apps.accounts.models import Account, AccountKind

# Credits sits above jobs and nodes in the layering (docs/design/serving.md): it reads them directly.
from apps.jobs import settle_queue
from apps.jobs.models import Deployment, Job, JobAttempt
from apps.jobs.states import JOB_TERMINAL
from apps.nodes.gpu_challenges import gpu_unverified_vram
from apps.nodes.models import Node
from apps.nodes.states import NodeState
from racon import ids
from racon.ids import AccountId, JobId, NodeId

from .ledger import (
    PostingLine,
    account_named,
    account_system,
    accounts_lock,
    entry_existing,
    ledger_post,
    ledger_write,
)
from .models import Entry, EntryKind
from .receipts import Payout, receipts_issue
from .rules import (
    NodeWork,
    amount_check,
    device_seconds_clamped,
    plan_work,
    seen_worker_bytes,
    settlement_split,
    standby_amount,
    standby_capped,
    standby_memory,
    token_cost,
)
from .selectors import ESCROW, FEES, HOLDS, MINT, account_key, earnings_total, escrow_held, job_hold

log = logging.getLogger("racon.credits")


class JobNotTerminal(ValueError):
    """Settlement was asked for a job that is still queued or running."""


def credit_reserve(
    *,
    account_id: AccountId,
    job_id: JobId,
    max_tokens: int,
    model_price_permille: int,
    now: datetime,
    prompt_tokens: int = 0,
) -> int:
    """Hold (prompt bound + max_tokens)' worth of credits for the job (once per job);
    InsufficientCredits if short.

    ``prompt_tokens`` is the most prompt tokens the job can be charged for: the caller bounds it
    by the prompt's bytes and by the slot's context less max_tokens (prompt_hold_tokens), so a
    2 MB prompt never holds 2 million tokens. Settlement charges the prompt and the completion,
    at most this hold. Call it in the transaction that creates the Job (the entry references it).
    The operator's system account has no floor, so it is never refused. Returns the micro-credits
    held.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be a non-negative integer, got {prompt_tokens!r}")
    if (
        isinstance(model_price_permille, bool)
        or not isinstance(model_price_permille, int)
        or model_price_permille < 0
    ):
        raise ValueError(
            f"model price weight must be a non-negative integer, got {model_price_permille!r}"
        )
    micro = settings.CREDITS_MICRO_PER_TOKEN
    amount = token_cost(
        tokens=prompt_tokens + max_tokens,
        price_permille=model_price_permille,
        micro_per_token=micro,
    )
    if amount == 0:
        return 0  # a free model: nothing to hold
    amount_check(amount, what="reservation")
    key = f"reserve:{job_id}"
    try:
        # One savepoint (in the job's transaction) or transaction: a key held before raises
        # IntegrityError out of it, with nothing of this call left.
        with transaction.atomic():
            # The consumer and system:holds, found and locked in one query.
            accounts = accounts_lock([account_id], names=[HOLDS])
            holds = account_named(accounts, HOLDS)
            ledger_write(
                key=key,
                kind=EntryKind.RESERVE,
                postings=[(account_id, -amount), (holds.pk, amount)],
                memo=f"hold for job {job_id}: {prompt_tokens} prompt + {max_tokens} completion tokens",
                now=now,
                job_id=job_id,
                data={
                    "prompt_tokens": prompt_tokens,
                    "max_tokens": max_tokens,
                    "price_permille": model_price_permille,
                    "micro_per_token": micro,
                },
                locked=accounts,
                savepoint=False,
            )
    except IntegrityError:
        entry = entry_existing(key=key, kind=EntryKind.RESERVE)
        if entry is None:
            raise
        return int(entry.postings.filter(account__name=HOLDS).aggregate(s=Sum("amount"))["s"] or 0)
    return amount


@dataclass
class _EarningRules:
    escrow_on: bool
    threshold: int
    earned: dict[str, int] = field(default_factory=dict)


def _earning_rules() -> _EarningRules:
    return _EarningRules(
        escrow_on=settings.CREDITS_ESCROW_ENABLED,
        threshold=settings.CREDITS_ESCROW_TRUST_THRESHOLD,
    )


def _to_escrow(*, rules: _EarningRules, owner: Account) -> bool:
    """A new contributor's earnings wait in escrow until its lifetime earnings reach the threshold."""
    if not rules.escrow_on or owner.kind == AccountKind.SYSTEM:
        return False
    key = account_key(owner.pk)
    if key not in rules.earned:
        rules.earned[key] = earnings_total(
            account_id=ids.account_id(owner.pk)
        )  # read under the owner's lock
    return rules.earned[key] < rules.threshold


def _escrow_release_if_due(
    *, owner_id: AccountId, escrow_id: AccountId, trigger: str, now: datetime
) -> Entry | None:
    """Pay out what escrow holds for the owner once it is trusted (or escrow was switched off)."""
    held = escrow_held(account_id=owner_id)
    if held <= 0:
        return None
    rules = _earning_rules()
    if rules.escrow_on and earnings_total(account_id=owner_id) < rules.threshold:
        return None
    return ledger_post(
        key=f"escrow-release:{owner_id}:{trigger}",
        kind=EntryKind.ESCROW_RELEASE,
        postings=[(escrow_id, -held, owner_id), (owner_id, held, owner_id)],
        memo="escrow released: trust threshold reached"
        if rules.escrow_on
        else "escrow released: escrow is off",
        now=now,
    )


def credit_settle_job(*, job_id: JobId, now: datetime) -> Entry:
    """Settle a terminal job exactly once: charge what was delivered, release the rest, pay the nodes.

    Charges prompt + completion tokens at the model's price, never more than the hold (what the
    hold does not cover is not charged, and the overrun is recorded), pays each node
    of the plan its share (settlement_split) to its owner or to escrow, releases the rest of the
    hold, and signs one receipt per participating node, all in one transaction. Completed, failed
    and cancelled jobs go through the same path. Repeated or concurrent calls return the one entry.
    """

    key = f"settle:{job_id}"
    # Settled before? The entry's unique key answers that when it is written (ledger_write),
    # without a query first: a settlement runs once per job but for a lost task's redelivery.
    job = Job.objects.select_related("model", "deployment").get(pk=job_id)
    if job.state not in JOB_TERMINAL:
        raise JobNotTerminal(f"job {job_id} is {job.state}, not terminal")

    tokens = job.prompt_tokens + job.completion_tokens
    parts = _attempt_parts(job)
    nodes = {
        str(n.pk): n for n in Node.objects.filter(pk__in=[w.node_id for p in parts for w in p.work])
    }
    for part in parts:
        part.work = [w for w in part.work if w.node_id in nodes]  # a gone node cannot be paid
        if part.primary not in nodes:
            part.primary = part.work[0].node_id if part.work else None
    work = _work_merged(parts)
    primaries = {p.primary for p in parts if p.primary is not None and p.weight > 0}
    primary = parts[-1].primary
    owners = {nid: account_key(n.account_id) for nid, n in nodes.items()}

    price = job.model.price_weight_permille
    micro = settings.CREDITS_MICRO_PER_TOKEN
    cost = token_cost(tokens=tokens, price_permille=price, micro_per_token=micro)
    fee_permille = min(max(settings.CREDITS_FEE_PERMILLE, 0), 1000)
    primary_permille = settings.CREDITS_PRIMARY_SHARE_PERMILLE
    rules = _earning_rules()

    try:
        with transaction.atomic():
            held, consumer_id = job_hold(job_id=ids.job_id(job.pk))
            if consumer_id is None and job.account_id is not None:
                consumer_id = account_key(job.account_id)
            lock = set(owners.values())
            if consumer_id is not None:
                lock.add(consumer_id)
            # The system accounts are found by name in the same locking query.
            accounts = accounts_lock(lock, names=[HOLDS, FEES, ESCROW])
            holds, fees, escrow = (account_named(accounts, n) for n in (HOLDS, FEES, ESCROW))
            escrow_before = escrow.balance

            # Never more than the hold: usage is a node's claim until counted, and a forged figure
            # (2,000,000,000 tokens) must not reach into the consumer's whole balance.
            charge = 0 if consumer_id is None else min(cost, held)
            fee = charge * fee_permille // 1000
            pool = charge - fee
            shares = _attempts_split(
                value=pool, parts=parts, primary_share_permille=primary_permille
            )
            if not shares:
                fee, pool = charge, 0  # nobody to pay (no plan): the value goes to fees

            postings: list[PostingLine] = []
            if held:
                postings.append((holds.pk, -held))
            if consumer_id is not None and held != charge:
                postings.append((consumer_id, held - charge))
            if fee:
                postings.append((fees.pk, fee))
            payouts: list[Payout] = []
            for w in work:
                owner = accounts[owners[w.node_id]]
                amount = shares.get(w.node_id, 0)
                escrowed = amount > 0 and _to_escrow(rules=rules, owner=owner)
                payouts.append(
                    Payout(
                        node_id=NodeId(w.node_id),
                        owner_id=owners[w.node_id],
                        amount=amount,
                        escrowed=escrowed,
                        layers=w.layers,
                        device_ms=w.device_ms,
                        primary=w.node_id in primaries,
                    )
                )
                if amount > 0:
                    postings.append((escrow.pk if escrowed else owner.pk, amount, owner.pk))

            entry, _ = ledger_write(
                key=key,
                kind=EntryKind.SETTLE,
                postings=postings,
                memo=f"job {job.pk} {job.state}: {tokens} tokens of {job.model.name}",
                now=now,
                job_id=ids.job_id(job.pk),
                data={
                    "state": job.state,
                    "prompt_tokens": job.prompt_tokens,
                    "completion_tokens": job.completion_tokens,
                    "price_permille": price,
                    "micro_per_token": micro,
                    "cost": cost,
                    "held": held,
                    "charged": charge,
                    "uncharged": cost - charge,
                    "fee": fee,
                    "value": pool,
                    "primary_node_id": primary,
                    "shares": {p.node_id: p.amount for p in payouts},
                    **(
                        {
                            "attempts": [
                                {"primary_node_id": p.primary, "tokens": p.weight} for p in parts
                            ]
                        }
                        if len(parts) > 1
                        else {}
                    ),
                },
                locked=accounts,
                savepoint=False,
            )
            receipts_issue(entry=entry, job=job, nodes=nodes, payouts=payouts, value=pool, now=now)
            # Escrow's balance is what it holds for every owner together (each owner's part is never
            # negative): with nothing held before and nothing escrowed now, no owner has any to release.
            if escrow_before > 0 or any(p.escrowed and p.amount > 0 for p in payouts):
                for owner_id in sorted({p.owner_id for p in payouts if p.amount > 0}):
                    _escrow_release_if_due(
                        owner_id=ids.account_id(owner_id),
                        escrow_id=ids.account_id(escrow.pk),
                        trigger=key,
                        now=now,
                    )
    except IntegrityError:
        # Settled before, or by a concurrent settlement we waited for: the settlement's key (the
        # entry's unique index) refused this one, and nothing of it stayed.
        existing = entry_existing(key=key, kind=EntryKind.SETTLE)
        if existing is None:
            raise
        return existing
    return entry


# A finished job's settlement task normally runs within a second; the sweep leaves it this long
# first, so that it only picks up what the task path lost.
SETTLE_SWEEP_GRACE_SECONDS = 10.0
SETTLE_SWEEP_BATCH = 200


def credit_settle_pending(
    *,
    now: datetime,
    grace_seconds: float = SETTLE_SWEEP_GRACE_SECONDS,
    limit: int = SETTLE_SWEEP_BATCH,
) -> list[Entry]:
    """Settle terminal jobs that still hold credits (a RESERVE and no SETTLE), oldest first.

    The settlement task is sent on commit of the job's end, through the broker: a worker killed
    while it held the task (redelivered only after the broker's visibility timeout) or a broker
    down when it was sent leaves the hold open. This sweep (beat) settles such jobs through
    credit_settle_job, whose idempotency key makes a race with a late task a no-op: each job is
    settled exactly once whoever gets there first. Returns the entries it wrote or found.
    """
    cutoff = now - timedelta(seconds=grace_seconds)
    settled = Entry.objects.filter(kind=EntryKind.SETTLE, job_id=OuterRef("job_id"))
    job_ids = list(
        Entry.objects.filter(kind=EntryKind.RESERVE, job__state__in=JOB_TERMINAL)
        .filter(
            Q(job__finished_at__lte=cutoff)
            | Q(job__finished_at__isnull=True, job__queued_at__lte=cutoff)
        )
        .exclude(Exists(settled))
        .order_by("created_at", "id")
        .values_list("job_id", flat=True)[:limit]
    )
    entries = _settle_each([ids.job_id(j) for j in job_ids], now=now, who="settle sweep")
    if entries:
        log.info("settle sweep: settled %d job(s) the settlement task had not", len(entries))
    return entries


def _settle_each(job_ids: list[JobId], *, now: datetime, who: str) -> list[Entry]:
    """credit_settle_job for each job; one that cannot be settled now is logged and left to the
    next sweep, so that it does not keep the others' holds open."""
    entries: list[Entry] = []
    for job_id in job_ids:
        try:
            entries.append(credit_settle_job(job_id=job_id, now=now))
        except JobNotTerminal:
            log.warning("%s: job %s is not terminal; not settled", who, job_id)
        except Exception:
            log.exception("%s: job %s could not be settled", who, job_id)
    return entries


SETTLE_BATCH_MAX = 1000  # jobs one batch task settles at most; the rest get a batch of their own


def credit_settle_batch(*, now: datetime, limit: int = SETTLE_BATCH_MAX) -> list[Entry]:
    """Settle the jobs queued by their ends (apps/jobs/settle_queue.py), each through
    credit_settle_job, until the queue is empty; past ``limit`` jobs what waits gets a batch of
    its own. A job that cannot be settled now is logged and left to the settlement sweep.
    Returns the entries written or found."""
    entries: list[Entry] = []
    taken = 0
    while taken < limit:
        batch = settle_queue.settle_take(limit=min(100, limit - taken))
        if not batch:
            if settle_queue.settle_round_end():
                continue
            return entries
        taken += len(batch)
        entries += _settle_each(batch, now=now, who="settle batch")
    if settle_queue.settle_round_end():
        settle_queue.settle_schedule()
    return entries


@dataclass
class _AttemptPart:
    """One attempt's share of a job: its plan's work and the tokens it is paid for."""

    primary: str | None
    work: list[NodeWork]
    weight: int  # tokens this attempt produced (the first attempt also evaluated the prompt)


def _attempt_parts(job: Job) -> list[_AttemptPart]:
    """The job's attempts as settlement parts; one part (the job's deployment) without failover.

    After a failover each attempt is paid for the completion tokens the controller counted on
    its own stream (JobAttempt.completion_tokens), the first also for the prompt: no node is paid
    for tokens another produced. The weights only divide the pool; what is charged is the job's
    own count, bounded by the hold, so a failover never charges the same tokens twice.
    """
    claimed = job.device_seconds if isinstance(job.device_seconds, dict) else None
    attempts = list(
        JobAttempt.objects.filter(job=job).select_related("deployment").order_by("number")
    )
    if len(attempts) <= 1:
        plan = (job.deployment.plan if job.deployment is not None else None) or {}
        device_seconds = device_seconds_clamped(
            claimed, plan=plan, wall_seconds=_wall_seconds(job.dispatched_at, job)
        )
        primary, work = plan_work(plan, device_seconds)
        return [
            _AttemptPart(
                primary=primary, work=work, weight=job.prompt_tokens + job.completion_tokens
            )
        ]
    parts = []
    for i, a in enumerate(attempts):
        plan = a.plan or (a.deployment.plan if a.deployment is not None else None) or {}
        last = i == len(attempts) - 1
        attempt_seconds = (
            device_seconds_clamped(
                claimed, plan=plan, wall_seconds=_wall_seconds(a.started_at, job, a.ended_at)
            )
            if last
            else None
        )
        primary, work = plan_work(plan, attempt_seconds)
        weight = int(a.completion_tokens) + (job.prompt_tokens if i == 0 else 0)
        parts.append(_AttemptPart(primary=primary, work=work, weight=weight))
    return parts


def _wall_seconds(start: datetime | None, job: Job, end: datetime | None = None) -> float:
    """An attempt's wall time as the controller saw it: from its dispatch (the job's queueing
    when none was recorded) to its end (the job's finish), never negative."""
    begin = start or job.dispatched_at or job.queued_at
    finish = end or job.finished_at
    if begin is None or finish is None:
        return 0.0
    return max((finish - begin).total_seconds(), 0.0)


def _work_merged(parts: list[_AttemptPart]) -> list[NodeWork]:
    """One NodeWork per node over all attempts (a node in two attempts' plans appears once)."""
    merged: dict[str, NodeWork] = {}
    for part in parts:
        for w in part.work:
            had = merged.get(w.node_id)
            if had is None:
                merged[w.node_id] = NodeWork(
                    node_id=w.node_id, layers=w.layers, device_ms=w.device_ms
                )
            else:
                ms = (had.device_ms or 0) + (w.device_ms or 0)
                merged[w.node_id] = NodeWork(
                    node_id=w.node_id, layers=max(had.layers, w.layers), device_ms=ms or None
                )
    return list(merged.values())


def attempts_split(*, value: int, weights: list[int]) -> list[int]:
    """``value`` divided in proportion to ``weights``, exactly (the remainder to the last weighted part)."""
    total = sum(max(w, 0) for w in weights)
    if total <= 0:
        return [0] * (len(weights) - 1) + [value] if weights else []
    out = [value * max(w, 0) // total for w in weights]
    last = max(i for i, w in enumerate(weights) if w > 0)
    out[last] += value - sum(out)
    return out


def _attempts_split(
    *, value: int, parts: list[_AttemptPart], primary_share_permille: int
) -> dict[str, int]:
    """Each attempt's part of ``value`` split over its own plan (settlement_split), summed per node."""
    if not any(p.work for p in parts):
        return {}  # nobody to pay: the caller sends the value to fees
    # A part without a payable node gets nothing; its tokens' value goes to those that did work.
    weights = [p.weight if p.work else 0 for p in parts]
    if sum(weights) <= 0:
        weights = [1 if p.work else 0 for p in parts]
    shares: dict[str, int] = {}
    values = attempts_split(value=value, weights=weights)
    for part, part_value in zip(parts, values, strict=True):
        got = settlement_split(
            value=part_value,
            work=part.work,
            primary_node_id=part.primary,
            tokens=part.weight,
            primary_share_permille=primary_share_permille,
        )
        for node_id, amount in got.items():
            shares[node_id] = shares.get(node_id, 0) + amount
    return shares


# --- standby reward --------------------------------------------------------------------------------


def credit_standby_reward(*, now: datetime) -> list[Entry]:
    """Pay every READY node for the time it lent since its last reward, once per node per period.

    Pay = CREDITS_STANDBY_PER_GIB_HOUR × GiB offered (free RAM + free VRAM) × hours, counted
    from the later of its last standby reward and its becoming READY, and at most one period
    (CREDITS_STANDBY_PERIOD_SECONDS) back. The figures are the node's claims, so: memory past
    CREDITS_STANDBY_UNSEEN_BYTES is paid only up to what the node was seen to hold (buffers another
    node's primary loaded onto it), and one node's pay per period is at most
    CREDITS_STANDBY_CAP_PER_PERIOD. Minted, to the owner or to escrow like any earning.
    """

    rate = settings.CREDITS_STANDBY_PER_GIB_HOUR
    period_s = settings.CREDITS_STANDBY_PERIOD_SECONDS
    if rate <= 0 or period_s <= 0:
        return []
    cap = settings.CREDITS_STANDBY_CAP_PER_PERIOD
    unseen = settings.CREDITS_STANDBY_UNSEEN_BYTES
    period = int(now.timestamp()) // period_s
    mint, escrow = account_system(name=MINT), account_system(name=ESCROW)
    seen = _seen_bytes_by_node() if unseen >= 0 else {}
    paid: list[Entry] = []
    for node in Node.objects.filter(state=NodeState.READY, revoked_at__isnull=True).order_by("pk"):
        key = f"standby:{node.pk}:{period}"
        if Entry.objects.filter(idempotency_key=key).exists():
            continue
        last = (
            Entry.objects.filter(kind=EntryKind.STANDBY, node=node)
            .order_by("-created_at")
            .values_list("created_at", flat=True)
            .first()
        )
        start = max(
            t
            for t in (last, node.state_changed_at, now - timedelta(seconds=period_s))
            if t is not None
        )
        elapsed_ms = (now - start) // timedelta(milliseconds=1)
        # An unverified GPU is credited at the floor until its challenge passes: its VRAM is
        # not paid for (apps/nodes/gpu_challenges.py).
        unverified = gpu_unverified_vram(hardware=node.hardware)
        claimed = max(node.ram_available, 0) + max(node.vram_free - unverified, 0)
        memory = standby_memory(
            claimed_bytes=claimed, seen_bytes=seen.get(str(node.pk), 0), unseen_allowance=unseen
        )
        uncapped = standby_amount(per_gib_hour=rate, memory_bytes=memory, elapsed_ms=elapsed_ms)
        amount = standby_capped(uncapped, cap=cap)
        if amount <= 0:
            continue
        try:
            amount_check(amount, what="standby reward")
            with transaction.atomic():
                accounts = accounts_lock({mint.pk, escrow.pk, node.account_id})
                owner = accounts[account_key(node.account_id)]
                escrowed = _to_escrow(rules=_earning_rules(), owner=owner)
                entry = ledger_post(
                    key=key,
                    kind=EntryKind.STANDBY,
                    postings=[
                        (mint.pk, -amount),
                        (escrow.pk if escrowed else owner.pk, amount, owner.pk),
                    ],
                    memo=f"standby: {memory / 1024**3:.1f} GiB for {elapsed_ms / 1000:.0f} s",
                    now=now,
                    node_id=ids.node_id(node.pk),
                    data={
                        "memory_bytes": memory,
                        "claimed_bytes": claimed,
                        "unverified_gpu_bytes": unverified,
                        "seen_bytes": seen.get(str(node.pk), 0),
                        "uncapped": uncapped,
                        "elapsed_ms": elapsed_ms,
                        "per_gib_hour": rate,
                        "period": period,
                        "escrowed": escrowed,
                    },
                )
                _escrow_release_if_due(
                    owner_id=ids.account_id(owner.pk),
                    escrow_id=ids.account_id(escrow.pk),
                    trigger=key,
                    now=now,
                )
        except (ValueError, IntegrityError):
            log.exception("standby reward for node %s failed", node.pk)
            continue
        paid.append(entry)
    return paid


def _seen_bytes_by_node() -> dict[str, int]:
    """Node → the most memory it was ever seen to hold for another node's primary (load reports)."""

    best: dict[str, int] = {}
    for plan, report in (
        Deployment.objects.exclude(load_report={}).values_list("plan", "load_report").iterator()
    ):
        if not isinstance(plan, dict) or not isinstance(report, dict):
            continue
        for node_id, nbytes in seen_worker_bytes(plan=plan, load_report=report).items():
            best[node_id] = max(best.get(node_id, 0), nbytes)
    return best
