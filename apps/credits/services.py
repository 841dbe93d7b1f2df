"""Credit writes: the ledger's one writer, grants, reservations, settlement, standby pay, receipts.

Locking: every transaction that moves credits first locks all the accounts it will touch with
SELECT … FOR UPDATE in one query ordered by primary key. One global order means two
transactions can never each hold a row the other waits for (no deadlocks), and a floor checked
under the lock cannot be raced below. On SQLite the whole database is locked per transaction
(transaction_mode IMMEDIATE), which gives the same guarantee more coarsely.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Sum
from django.utils import timezone

# Credits sits above jobs and nodes in the layering (docs/design/serving.md): it reads them directly.
from apps.jobs.models import Deployment, Job
from apps.jobs.states import JOB_TERMINAL
from apps.nodes.models import Node
from apps.nodes.states import NodeState

from . import signing
from .models import Account, AccountKind, Entry, EntryKind, Posting, Receipt
from .rules import (
    MAX_AMOUNT,
    amount_check,
    plan_work,
    seen_worker_bytes,
    settlement_split,
    share_ppm,
    standby_amount,
    standby_capped,
    standby_memory,
    token_cost,
)
from .selectors import (  # account_standing is re-exported: the /v1 API imports it from here
    ESCROW,
    FEES,
    HOLDS,
    MINT,
    SYSTEM_FLOORS,
    account_key,
    account_standing,
    earnings_total,
    escrow_held,
    job_hold,
)

__all__ = [
    "InsufficientCredits",
    "JobNotTerminal",
    "account_create",
    "account_for_user",
    "account_standing",
    "account_system",
    "credit_adjust",
    "credit_grant",
    "credit_reserve",
    "credit_settle_job",
    "credit_standby_reward",
    "ledger_post",
    "ledger_verify",
    "receipt_check",
    "receipt_public_key",
    "receipt_signing_key",
]

log = logging.getLogger("racon.credits")

PostingLine = tuple[Any, int] | tuple[Any, int, Any]


class InsufficientCredits(Exception):
    """The account lacks the credits above its floor (the /v1 API answers 429 insufficient_quota)."""

    def __init__(self, *, account_id: Any, needed: int, available: int) -> None:
        super().__init__(
            f"account {account_id} has {max(available, 0)} micro-credits available, {needed} needed"
        )
        self.account_id = account_id
        self.needed = needed
        self.available = available


class JobNotTerminal(ValueError):
    """Settlement was asked for a job that is still queued or running."""


# --- accounts -------------------------------------------------------------------------------------


def account_system(*, name: str) -> Account:
    """Get or create a system account (unbounded floor, except holds and escrow which floor at 0)."""
    acct = Account.objects.filter(name=name).first()
    if acct is not None:
        return acct
    try:
        with transaction.atomic():
            return Account.objects.create(
                name=name, kind=AccountKind.SYSTEM, floor=SYSTEM_FLOORS.get(name)
            )
    except IntegrityError:
        return Account.objects.get(name=name)


def account_for_user(*, user: Any) -> Account:
    """The user's own account, created (with its starting grant) on first use, once."""
    acct = Account.objects.filter(user=user).first()
    if acct is not None:
        return acct
    try:
        return account_create(name=f"user:{user.get_username()}", user_id=user.pk)
    except IntegrityError:
        # Two first requests of one user raced; the other created it.
        acct = Account.objects.filter(user=user).first()
        if acct is None:
            raise
        return acct


def account_create(
    *, name: str, user_id: Any = None, kind: str = AccountKind.USER, now: datetime | None = None
) -> Account:
    """Create a user or organisation account with its starting grant, in one transaction."""
    grant = int(getattr(settings, "CREDITS_STARTING_GRANT", 0) or 0)
    mint = account_system(name=MINT) if grant > 0 and kind != AccountKind.SYSTEM else None
    with transaction.atomic():
        acct = Account.objects.create(name=name, user_id=user_id, kind=kind)
        if mint is not None:
            ledger_post(
                key=f"grant:starting:{acct.pk}",
                kind=EntryKind.GRANT,
                postings=[(mint.pk, -grant), (acct.pk, grant)],
                memo="starting grant",
                now=now or timezone.now(),
            )
            acct.refresh_from_db(fields=["balance"])
    return acct


def _locked_accounts(ids: Iterable[Any]) -> dict[str, Account]:
    """Lock the accounts in primary-key order (the one global lock order); all must exist."""
    keys = sorted({account_key(i) for i in ids})
    rows = {
        account_key(a.pk): a
        for a in Account.objects.select_for_update().filter(pk__in=keys).order_by("pk")
    }
    missing = [k for k in keys if k not in rows]
    if missing:
        raise ValueError(f"unknown account(s): {', '.join(missing)}")
    return rows


# --- the ledger's one writer --------------------------------------------------------------------


def _entry_existing(*, key: str, kind: str) -> Entry | None:
    entry = Entry.objects.filter(idempotency_key=key).first()
    if entry is not None and entry.kind != kind:
        raise ValueError(f"idempotency key {key!r} already names a {entry.kind} entry, not {kind}")
    return entry


def ledger_post(
    *,
    key: str,
    kind: str,
    postings: Sequence[PostingLine],
    memo: str,
    now: datetime,
    job_id: Any = None,
    node_id: Any = None,
    data: dict[str, Any] | None = None,
) -> Entry:
    """Write one balanced entry exactly once per key, or raise and write nothing.

    Postings are (account_id, amount) or (account_id, amount, beneficiary_id). They must sum to
    zero; amounts are non-zero integers within ±2^62. A posting that would take an account below
    its floor raises InsufficientCredits. A second call with the same key — sequential,
    concurrent or after a crash — returns the first entry and writes nothing.
    """
    if not isinstance(key, str) or not key or len(key) > 200:
        raise ValueError("idempotency key must be a non-empty string of at most 200 characters")
    if kind not in EntryKind.values:
        raise ValueError(f"unknown entry kind {kind!r}")
    lines: dict[tuple[str, str | None], int] = {}
    for posting in postings:
        if len(posting) not in (2, 3):
            raise ValueError(
                f"a posting is (account_id, amount[, beneficiary_id]), got {posting!r}"
            )
        account_id, amount = posting[0], posting[1]
        beneficiary = posting[2] if len(posting) == 3 else None  # type: ignore[misc]
        amount_check(amount, what="posting amount", allow_negative=True)
        k = (account_key(account_id), account_key(beneficiary) if beneficiary is not None else None)
        lines[k] = lines.get(k, 0) + amount
    if sum(lines.values()) != 0:
        raise ValueError(f"postings of {key!r} sum to {sum(lines.values())}, not zero")
    lines = {k: v for k, v in lines.items() if v != 0}
    net: dict[str, int] = {}
    for (account_id, _), amount in lines.items():
        net[account_id] = net.get(account_id, 0) + amount

    existing = _entry_existing(key=key, kind=kind)
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            accounts = _locked_accounts(net)
            # The first writer may have committed while we waited for the locks.
            existing = _entry_existing(key=key, kind=kind)
            if existing is not None:
                return existing
            for account_id, delta in net.items():
                acct = accounts[account_id]
                after = acct.balance + delta
                if abs(after) > MAX_AMOUNT:
                    raise ValueError(
                        f"account {acct.name} would overflow (limit ±2^62 micro-credits)"
                    )
                if delta < 0 and acct.floor is not None and after < acct.floor:
                    raise InsufficientCredits(
                        account_id=acct.pk, needed=-delta, available=acct.balance - acct.floor
                    )
            entry = Entry.objects.create(
                idempotency_key=key,
                kind=kind,
                memo=memo[:500],
                job_id=job_id,
                node_id=node_id,
                data=data or {},
                created_at=now,
            )
            Posting.objects.bulk_create(
                [
                    Posting(
                        entry=entry,
                        account_id=account_id,
                        amount=amount,
                        beneficiary_id=beneficiary,
                    )
                    for (account_id, beneficiary), amount in sorted(
                        lines.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
                    )
                ]
            )
            for account_id, delta in sorted(net.items()):
                if delta:
                    Account.objects.filter(pk=account_id).update(balance=F("balance") + delta)
    except IntegrityError:
        # Lost the race on the unique key: the winner's entry is committed and visible now.
        existing = _entry_existing(key=key, kind=kind)
        if existing is None:
            raise
        return existing
    return entry


# --- grants and adjustments ---------------------------------------------------------------------


def _reason_check(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise ValueError("a reason is required")
    return reason[:500]


def credit_grant(
    *, account_id: Any, amount: int, reason: str, now: datetime, key: str | None = None
) -> Entry:
    """Mint ``amount`` (> 0) into the account, as one entry carrying the reason."""
    amount_check(amount, what="grant")
    return _mint_move(
        account_id=account_id,
        amount=amount,
        reason=_reason_check(reason),
        now=now,
        kind=EntryKind.GRANT,
        key=key,
    )


def credit_adjust(
    *, account_id: Any, amount: int, reason: str, now: datetime, key: str | None = None
) -> Entry:
    """Add (or, when negative, take back to the mint down to the floor) ``amount``, with the reason."""
    amount_check(amount, what="adjustment", allow_negative=True)
    return _mint_move(
        account_id=account_id,
        amount=amount,
        reason=_reason_check(reason),
        now=now,
        kind=EntryKind.ADJUST,
        key=key,
    )


def _mint_move(
    *, account_id: Any, amount: int, reason: str, now: datetime, kind: str, key: str | None
) -> Entry:
    mint = account_system(name=MINT)
    if account_key(account_id) == account_key(mint.pk):
        raise ValueError("the mint cannot grant to itself")
    if not Account.objects.filter(pk=account_id).exists():
        raise ValueError(f"unknown account {account_id}")
    return ledger_post(
        # The caller's key is scoped to the account: one retried request, one entry.
        key=f"{kind.lower()}:{account_key(account_id)}:{key or uuid.uuid4().hex}",
        kind=kind,
        postings=[(mint.pk, -amount), (account_id, amount)],
        memo=reason,
        now=now,
    )


# --- spending -------------------------------------------------------------------------------------


def credit_reserve(
    *, account_id: Any, job_id: Any, max_tokens: int, model_price_permille: int, now: datetime
) -> int:
    """Hold max_tokens' worth of credits for the job (once per job); InsufficientCredits if short.

    Call it in the transaction that creates the Job (the entry references it). The operator's
    system account has no floor, so it is never refused. Returns the micro-credits held.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if (
        isinstance(model_price_permille, bool)
        or not isinstance(model_price_permille, int)
        or model_price_permille < 0
    ):
        raise ValueError(
            f"model price weight must be a non-negative integer, got {model_price_permille!r}"
        )
    micro = int(getattr(settings, "CREDITS_MICRO_PER_TOKEN", 1_000))
    amount = token_cost(
        tokens=max_tokens, price_permille=model_price_permille, micro_per_token=micro
    )
    if amount == 0:
        return 0  # a free model: nothing to hold
    amount_check(amount, what="reservation")
    holds = account_system(name=HOLDS)
    entry = ledger_post(
        key=f"reserve:{job_id}",
        kind=EntryKind.RESERVE,
        postings=[(account_id, -amount), (holds.pk, amount)],
        memo=f"hold for job {job_id}: {max_tokens} tokens",
        now=now,
        job_id=job_id,
        data={
            "max_tokens": max_tokens,
            "price_permille": model_price_permille,
            "micro_per_token": micro,
        },
    )
    return int(entry.postings.filter(account_id=holds.pk).aggregate(s=Sum("amount"))["s"] or 0)


@dataclass
class _Payout:
    node_id: str
    owner_id: str
    amount: int
    escrowed: bool
    layers: int = 0
    device_ms: int | None = None
    primary: bool = False


@dataclass
class _EarningRules:
    escrow_on: bool
    threshold: int
    earned: dict[str, int] = field(default_factory=dict)


def _earning_rules() -> _EarningRules:
    return _EarningRules(
        escrow_on=bool(getattr(settings, "CREDITS_ESCROW_ENABLED", False)),
        threshold=int(getattr(settings, "CREDITS_ESCROW_TRUST_THRESHOLD", 0)),
    )


def _to_escrow(*, rules: _EarningRules, owner: Account) -> bool:
    """A new contributor's earnings wait in escrow until its lifetime earnings reach the threshold."""
    if not rules.escrow_on or owner.kind == AccountKind.SYSTEM:
        return False
    key = account_key(owner.pk)
    if key not in rules.earned:
        rules.earned[key] = earnings_total(account_id=owner.pk)  # read under the owner's lock
    return rules.earned[key] < rules.threshold


def _escrow_release_if_due(
    *, owner_id: str, escrow_id: Any, trigger: str, now: datetime
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


def credit_settle_job(*, job_id: Any, now: datetime) -> Entry:
    """Settle a terminal job exactly once: charge what was delivered, release the rest, pay the nodes.

    Charges prompt + completion tokens at the model's price, never more than the hold (what the
    hold does not cover is not charged, and the overrun is recorded), pays each node
    of the plan its share (settlement_split) to its owner or to escrow, releases the rest of the
    hold, and signs one receipt per participating node, all in one transaction. Completed, failed
    and cancelled jobs go through the same path. Repeated or concurrent calls return the one entry.
    """

    key = f"settle:{job_id}"
    existing = _entry_existing(key=key, kind=EntryKind.SETTLE)
    if existing is not None:
        return existing
    job = Job.objects.select_related("model", "deployment").get(pk=job_id)
    if job.state not in JOB_TERMINAL:
        raise JobNotTerminal(f"job {job_id} is {job.state}, not terminal")

    plan = (job.deployment.plan if job.deployment is not None else None) or {}
    primary, work = plan_work(
        plan, job.device_seconds if isinstance(job.device_seconds, dict) else None
    )
    nodes = {str(n.pk): n for n in Node.objects.filter(pk__in=[w.node_id for w in work])}
    work = [w for w in work if w.node_id in nodes]  # a node row that is gone cannot be paid
    if primary not in nodes:
        primary = work[0].node_id if work else None
    owners = {nid: account_key(n.account_id) for nid, n in nodes.items()}

    tokens = job.prompt_tokens + job.completion_tokens
    price = job.model.price_weight_permille
    micro = int(getattr(settings, "CREDITS_MICRO_PER_TOKEN", 1_000))
    cost = token_cost(tokens=tokens, price_permille=price, micro_per_token=micro)
    fee_permille = min(max(int(getattr(settings, "CREDITS_FEE_PERMILLE", 0)), 0), 1000)
    primary_permille = int(getattr(settings, "CREDITS_PRIMARY_SHARE_PERMILLE", 0))
    holds, fees, escrow = (account_system(name=n) for n in (HOLDS, FEES, ESCROW))
    rules = _earning_rules()

    with transaction.atomic():
        held, consumer_id = job_hold(job_id=job.pk)
        if consumer_id is None and job.account_id is not None:
            consumer_id = account_key(job.account_id)
        lock = {holds.pk, fees.pk, escrow.pk, *owners.values()}
        if consumer_id is not None:
            lock.add(consumer_id)
        accounts = _locked_accounts(lock)
        existing = _entry_existing(key=key, kind=EntryKind.SETTLE)
        if existing is not None:
            return existing  # a concurrent settlement won while we waited for the locks

        # Never more than the hold: usage is a node's claim until counted, and a forged figure
        # (2,000,000,000 tokens) must not reach into the consumer's whole balance.
        charge = 0 if consumer_id is None else min(cost, held)
        fee = charge * fee_permille // 1000
        pool = charge - fee
        shares = settlement_split(
            value=pool,
            work=work,
            primary_node_id=primary,
            tokens=tokens,
            primary_share_permille=primary_permille,
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
        payouts: list[_Payout] = []
        for w in work:
            owner = accounts[owners[w.node_id]]
            amount = shares.get(w.node_id, 0)
            escrowed = amount > 0 and _to_escrow(rules=rules, owner=owner)
            payouts.append(
                _Payout(
                    node_id=w.node_id,
                    owner_id=owners[w.node_id],
                    amount=amount,
                    escrowed=escrowed,
                    layers=w.layers,
                    device_ms=w.device_ms,
                    primary=w.node_id == primary,
                )
            )
            if amount > 0:
                postings.append((escrow.pk if escrowed else owner.pk, amount, owner.pk))

        entry = ledger_post(
            key=key,
            kind=EntryKind.SETTLE,
            postings=postings,
            memo=f"job {job.pk} {job.state}: {tokens} tokens of {job.model.name}",
            now=now,
            job_id=job.pk,
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
            },
        )
        _receipts_issue(entry=entry, job=job, nodes=nodes, payouts=payouts, value=pool, now=now)
        for owner_id in sorted({p.owner_id for p in payouts if p.amount > 0}):
            _escrow_release_if_due(owner_id=owner_id, escrow_id=escrow.pk, trigger=key, now=now)
    return entry


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

    rate = int(getattr(settings, "CREDITS_STANDBY_PER_GIB_HOUR", 0))
    period_s = int(getattr(settings, "CREDITS_STANDBY_PERIOD_SECONDS", 600))
    if rate <= 0 or period_s <= 0:
        return []
    cap = int(getattr(settings, "CREDITS_STANDBY_CAP_PER_PERIOD", 0))
    unseen = int(getattr(settings, "CREDITS_STANDBY_UNSEEN_BYTES", -1))
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
        claimed = max(node.ram_available, 0) + max(node.vram_free, 0)
        memory = standby_memory(claimed_bytes=claimed, seen_bytes=seen.get(str(node.pk), 0), unseen_allowance=unseen)
        uncapped = standby_amount(per_gib_hour=rate, memory_bytes=memory, elapsed_ms=elapsed_ms)
        amount = standby_capped(uncapped, cap=cap)
        if amount <= 0:
            continue
        try:
            amount_check(amount, what="standby reward")
            with transaction.atomic():
                accounts = _locked_accounts({mint.pk, escrow.pk, node.account_id})
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
                    node_id=node.pk,
                    data={
                        "memory_bytes": memory,
                        "claimed_bytes": claimed,
                        "seen_bytes": seen.get(str(node.pk), 0),
                        "uncapped": uncapped,
                        "elapsed_ms": elapsed_ms,
                        "per_gib_hour": rate,
                        "period": period,
                        "escrowed": escrowed,
                    },
                )
                _escrow_release_if_due(
                    owner_id=account_key(owner.pk), escrow_id=escrow.pk, trigger=key, now=now
                )
        except (ValueError, IntegrityError):
            log.exception("standby reward for node %s failed", node.pk)
            continue
        paid.append(entry)
    return paid


def _seen_bytes_by_node() -> dict[str, int]:
    """Node → the most memory it was ever seen to hold for another node's primary (load reports)."""

    best: dict[str, int] = {}
    for plan, report in Deployment.objects.exclude(load_report={}).values_list("plan", "load_report").iterator():
        if not isinstance(plan, dict) or not isinstance(report, dict):
            continue
        for node_id, nbytes in seen_worker_bytes(plan=plan, load_report=report).items():
            best[node_id] = max(best.get(node_id, 0), nbytes)
    return best


# --- receipts ---------------------------------------------------------------------------------------


def _receipts_issue(
    *,
    entry: Entry,
    job: Any,
    nodes: dict[str, Any],
    payouts: list[_Payout],
    value: int,
    now: datetime,
) -> list[Receipt]:
    """One signed receipt per participating node, in the settlement's transaction."""
    key = receipt_signing_key()
    kid = signing.key_id(key)
    out = []
    for p in payouts:
        rid = uuid.uuid4()
        payload = {
            "version": signing.RECEIPT_VERSION,
            "receipt_id": str(rid),
            "key_id": kid,
            "job_id": str(job.pk),
            "job_state": job.state,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
            "node_id": p.node_id,
            "node_name": nodes[p.node_id].name,
            "account_id": p.owner_id,
            "model": job.model.name,
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "tokens": job.prompt_tokens + job.completion_tokens,
            "layers": p.layers,
            "device_ms": p.device_ms,
            "primary": p.primary,
            "job_value": value,
            "share_ppm": share_ppm(p.amount, value),
            "credits": p.amount,
            "escrowed": p.escrowed,
            "entry_id": entry.pk,
            "issued_at": now.isoformat(),
        }
        out.append(
            Receipt(
                id=rid,
                entry=entry,
                job_id=job.pk,
                node_id=p.node_id,
                account_id=p.owner_id,
                model_name=job.model.name,
                tokens=payload["tokens"],
                layers=p.layers,
                share_ppm=payload["share_ppm"],
                credits=p.amount,
                escrowed=p.escrowed,
                is_primary=p.primary,
                issued_at=now,
                payload=payload,
                signature=signing.receipt_sign(payload, key),
                key_id=kid,
            )
        )
    return Receipt.objects.bulk_create(out)


def receipt_signing_key() -> Ed25519PrivateKey:
    """The controller's receipt key: RACON_RECEIPT_KEY (base64 raw), else VAR_DIR/receipt-signing.key (made 0600)."""
    configured = getattr(settings, "RACON_RECEIPT_KEY", "") or os.environ.get(
        "RACON_RECEIPT_KEY", ""
    )
    if configured:
        return _key_from_b64(configured)
    path = (
        getattr(settings, "CREDITS_RECEIPT_KEY_PATH", None)
        or Path(settings.VAR_DIR) / "receipt-signing.key"
    )
    return _key_from_file(str(path))


@functools.lru_cache(maxsize=4)
def _key_from_b64(text: str) -> Ed25519PrivateKey:
    return signing.private_key_from_b64(text)


@functools.lru_cache(maxsize=8)
def _key_from_file(path_str: str) -> Ed25519PrivateKey:
    path = Path(path_str)
    try:
        return signing.private_key_from_b64(path.read_text())
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = signing.private_key_generate()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".receipt-signing-")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(signing.private_key_to_b64(key) + "\n")
        try:
            # link() never replaces: if another process created the key first, its key wins.
            os.link(tmp, path)
        except FileExistsError:
            key = signing.private_key_from_b64(path.read_text())
    finally:
        os.unlink(tmp)
    log.info("created receipt signing key %s (key id %s)", path, signing.key_id(key))
    return key


def receipt_public_key() -> dict[str, str]:
    """The public half of the receipt key, for offline verification."""
    key = receipt_signing_key()
    return {
        "algorithm": signing.ALGORITHM,
        "key_id": signing.key_id(key),
        "public_key": base64.b64encode(signing.public_key_raw(key)).decode(),
        "pem": signing.public_key_pem(key),
    }


def receipt_check(*, receipt: Any) -> signing.VerifyResult:
    """Verify a receipt against this controller's public key: any altered field fails."""
    return signing.receipt_verify(receipt, receipt_signing_key().public_key())


# --- verification -------------------------------------------------------------------------------------


@dataclass
class LedgerReport:
    entries: int = 0
    postings: int = 0
    accounts: int = 0
    total_minted: int = 0
    unbalanced_entries: list[dict[str, Any]] = field(default_factory=list)
    balance_mismatches: list[dict[str, Any]] = field(default_factory=list)
    below_floor: list[dict[str, Any]] = field(default_factory=list)
    holds_mismatch: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return not (
            self.unbalanced_entries
            or self.balance_mismatches
            or self.below_floor
            or self.holds_mismatch
        )


def ledger_verify() -> LedgerReport:
    """Prove the ledger: every entry sums to zero, cached balances equal the replay, floors hold."""
    report = LedgerReport(
        entries=Entry.objects.count(),
        postings=Posting.objects.count(),
        accounts=Account.objects.count(),
    )
    for row in (
        Posting.objects.values("entry_id")
        .annotate(total=Sum("amount"))
        .exclude(total=0)
        .order_by("entry_id")
    ):
        report.unbalanced_entries.append({"entry_id": row["entry_id"], "sum": int(row["total"])})
    replay = {
        account_key(r["account_id"]): int(r["total"] or 0)
        for r in Posting.objects.values("account_id").annotate(total=Sum("amount")).order_by()
    }
    for acct in Account.objects.order_by("name"):
        replayed = replay.get(account_key(acct.pk), 0)
        if acct.balance != replayed:
            report.balance_mismatches.append(
                {
                    "account_id": str(acct.pk),
                    "name": acct.name,
                    "cached": acct.balance,
                    "replayed": replayed,
                }
            )
        if acct.floor is not None and acct.balance < acct.floor:
            report.below_floor.append(
                {
                    "account_id": str(acct.pk),
                    "name": acct.name,
                    "balance": acct.balance,
                    "floor": acct.floor,
                }
            )
        if acct.name == MINT:
            report.total_minted = -replayed
    holds = Account.objects.filter(name=HOLDS).first()
    if holds is not None:
        settled = Entry.objects.filter(kind=EntryKind.SETTLE, job_id=OuterRef("entry__job_id"))
        open_total = int(
            Posting.objects.filter(account=holds, entry__kind=EntryKind.RESERVE)
            .exclude(Exists(settled))
            .aggregate(s=Sum("amount"))["s"]
            or 0
        )
        if open_total != replay.get(account_key(holds.pk), 0):
            report.holds_mismatch = {
                "holds": replay.get(account_key(holds.pk), 0),
                "open_reservations": open_total,
            }
    return report
