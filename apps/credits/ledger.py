"""The ledger's one writer (ledger_post), accounts and their balances, grants, and ledger_verify.

Every credit movement in the codebase is one ``ledger_post`` call: settlement and standby pay
(settlement.py) build their postings and hand them here; nothing else writes Entry, Posting or
``Account.balance``.

Locking: every transaction that moves credits first locks all the accounts it will touch with
SELECT … FOR UPDATE in one query ordered by primary key. One global order means two
transactions can never each hold a row the other waits for (no deadlocks), and a floor checked
under the lock cannot be raced below. On SQLite the whole database is locked per transaction
(transaction_mode IMMEDIATE), which gives the same guarantee more coarsely.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import BigIntegerField, Case, Exists, F, OuterRef, Sum, Value, When
from django.utils import timezone

from apps.accounts.models import Account, AccountKind
from racon import ids
from racon.ids import AccountId, JobId, NodeId, as_uuid

from .models import Entry, EntryKind, Posting
from .rules import MAX_AMOUNT, amount_check
from .selectors import HOLDS, MINT, SYSTEM_FLOORS, account_key

PostingLine = tuple[Any, int] | tuple[Any, int, Any]


class InsufficientCredits(Exception):
    """The account lacks the credits above its floor (the /v1 API answers 429 insufficient_quota)."""

    def __init__(self, *, account_id: AccountId, needed: int, available: int) -> None:
        super().__init__(
            f"account {account_id} has {max(available, 0)} micro-credits available, {needed} needed"
        )
        self.account_id = account_id
        self.needed = needed
        self.available = available


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
    *,
    name: str,
    user_id: int | None = None,
    kind: str = AccountKind.USER,
    now: datetime | None = None,
) -> Account:
    """Create a user or organisation account with its starting grant, in one transaction."""
    grant = settings.CREDITS_STARTING_GRANT
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


def accounts_lock(ids: Iterable[Any], *, names: Iterable[str] = ()) -> dict[str, Account]:
    """Lock the accounts in primary-key order (the one global lock order); all must exist.

    ``names`` are system accounts (account_system), found together in one query and created when
    missing before any row is locked (a first use that created one while holding another
    account's lock could deadlock with a concurrent first use), then locked with the others.
    """
    keys = {account_key(i) for i in ids}
    wanted = sorted(set(names))
    if wanted:
        found = dict(Account.objects.filter(name__in=wanted).values_list("name", "pk"))
        for name in wanted:
            if name not in found:
                found[name] = account_system(name=name).pk
        keys |= {account_key(pk) for pk in found.values()}
    ordered = sorted(keys)
    rows = {
        account_key(a.pk): a
        for a in Account.objects.select_for_update().filter(pk__in=ordered).order_by("pk")
    }
    missing = [k for k in ordered if k not in rows]
    if missing:
        raise ValueError(f"unknown account(s): {', '.join(missing)}")
    return rows


def account_named(accounts: dict[str, Account], name: str) -> Account:
    """The account of this name among those accounts_lock returned."""
    for acct in accounts.values():
        if acct.name == name:
            return acct
    raise KeyError(name)


# --- the ledger's one writer --------------------------------------------------------------------


def entry_existing(*, key: str, kind: str) -> Entry | None:
    """The entry already written under this idempotency key (ValueError if it is another kind)."""
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
    job_id: JobId | None = None,
    node_id: NodeId | None = None,
    data: dict[str, Any] | None = None,
) -> Entry:
    """Write one balanced entry exactly once per key, or raise and write nothing.

    Postings are (account_id, amount) or (account_id, amount, beneficiary_id). They must sum to
    zero; amounts are non-zero integers within ±2^62. A posting that would take an account below
    its floor raises InsufficientCredits. A second call with the same key — sequential,
    concurrent or after a crash — returns the first entry and writes nothing.
    """
    return ledger_write(
        key=key,
        kind=kind,
        postings=postings,
        memo=memo,
        now=now,
        job_id=job_id,
        node_id=node_id,
        data=data,
    )[0]


def ledger_write(
    *,
    key: str,
    kind: str,
    postings: Sequence[PostingLine],
    memo: str,
    now: datetime,
    job_id: JobId | None = None,
    node_id: NodeId | None = None,
    data: dict[str, Any] | None = None,
    locked: dict[str, Account] | None = None,
    savepoint: bool = True,
) -> tuple[Entry, bool]:
    """ledger_post, and whether this call wrote the entry (False: the key's first entry).

    ``locked``: accounts the caller already locked in this transaction (accounts_lock), whose
    balances are current (ledger_write keeps them so): they are not locked again. Whether the key was written before
    is answered by its unique index, not by a query first: the entry is inserted before any
    balance moves, so a second writer's insert fails (a concurrent one's once the first commits)
    and nothing of it stays.

    ``savepoint=False`` (inside the caller's transaction): no savepoint of its own, so a key
    written before raises IntegrityError, which leaves the caller's transaction to roll back:
    the caller catches it outside its transaction (credit_settle_job).
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
        beneficiary = posting[2] if len(posting) == 3 else None
        amount_check(amount, what="posting amount", allow_negative=True)
        k = (account_key(account_id), account_key(beneficiary) if beneficiary is not None else None)
        lines[k] = lines.get(k, 0) + amount
    if sum(lines.values()) != 0:
        raise ValueError(f"postings of {key!r} sum to {sum(lines.values())}, not zero")
    lines = {k: v for k, v in lines.items() if v != 0}
    net: dict[str, int] = {}
    for (account_id, _), amount in lines.items():
        net[account_id] = net.get(account_id, 0) + amount

    write = functools.partial(
        _entry_write,
        key=key,
        kind=kind,
        lines=lines,
        net=net,
        memo=memo,
        now=now,
        job_id=job_id,
        node_id=node_id,
        data=data,
        locked=locked,
    )
    if not savepoint:
        with transaction.atomic(savepoint=False):
            return write(), True
    try:
        with transaction.atomic():
            entry = write()
    except IntegrityError:
        # The key was written before (or by a concurrent writer, committed now): its entry.
        existing = entry_existing(key=key, kind=kind)
        if existing is None:
            raise
        return existing, False
    return entry, True


def _entry_write(
    *,
    key: str,
    kind: str,
    lines: dict[tuple[str, str | None], int],
    net: dict[str, int],
    memo: str,
    now: datetime,
    job_id: JobId | None,
    node_id: NodeId | None,
    data: dict[str, Any] | None,
    locked: dict[str, Account] | None,
) -> Entry:
    """ledger_write's writes, in the caller's transaction."""
    if locked is not None and all(a in locked for a in net):
        accounts = locked
    else:
        accounts = accounts_lock(net)
    # First, under the locks: a key written before (or by a writer we waited for) fails here on
    # the unique index, before anything else is written.
    entry = Entry.objects.create(
        idempotency_key=key,
        kind=kind,
        memo=memo[:500],
        # the row's foreign keys as UUIDs, as a row read back would hold them
        job_id=as_uuid(job_id) if job_id is not None else None,
        node_id=as_uuid(node_id) if node_id is not None else None,
        data=data or {},
        created_at=now,
    )
    for account_id, delta in net.items():
        acct = accounts[account_id]
        after = acct.balance + delta
        if abs(after) > MAX_AMOUNT:
            raise ValueError(f"account {acct.name} would overflow (limit ±2^62 micro-credits)")
        if delta < 0 and acct.floor is not None and after < acct.floor:
            raise InsufficientCredits(
                account_id=ids.account_id(acct.pk),
                needed=-delta,
                available=acct.balance - acct.floor,
            )
    Posting.objects.bulk_create(
        [
            Posting(entry=entry, account_id=account_id, amount=amount, beneficiary_id=beneficiary)
            for (account_id, beneficiary), amount in sorted(
                lines.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
            )
        ]
    )
    moved = {a: d for a, d in net.items() if d}
    if moved:
        # Every balance in one statement.
        Account.objects.filter(pk__in=list(moved)).update(
            balance=F("balance")
            + Case(
                *(When(pk=a, then=Value(d)) for a, d in sorted(moved.items())),
                default=Value(0),
                output_field=BigIntegerField(),
            )
        )
        for a, d in moved.items():
            if a in accounts:
                accounts[a].balance += d  # the caller's locked rows stay current
    return entry


# --- grants and adjustments ---------------------------------------------------------------------


def _reason_check(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise ValueError("a reason is required")
    return reason[:500]


def credit_grant(
    *, account_id: AccountId, amount: int, reason: str, now: datetime, key: str | None = None
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
    *, account_id: AccountId, amount: int, reason: str, now: datetime, key: str | None = None
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
    *, account_id: AccountId, amount: int, reason: str, now: datetime, kind: str, key: str | None
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
