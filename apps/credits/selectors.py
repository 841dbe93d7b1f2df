"""Reads over accounts, the ledger and receipts. No writes here."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Exists, F, OuterRef, Q, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from apps.accounts.models import Account, AccountKind, ApiKey
from apps.jobs.admission import priority_bonus
from apps.jobs.models import Job
from racon import ids
from racon.ids import AccountId, JobId, NodeId

from .models import EARNING_KINDS, Entry, EntryKind, Posting, Receipt
from .rules import MAX_AMOUNT, job_priority_order

__all__ = [
    "account_standing",
    "account_summary",
    "earnings_since",
    "earnings_total",
    "escrow_held",
    "job_hold",
    "job_priority_order",
    "key_usage",
    "ledger_postings",
    "open_holds",
    "receipt_list",
]

# Names of the system accounts. Holds and escrow carry a floor of 0: they only ever hold what was
# put in them, so a bug that would take them negative raises instead of inventing credits.
MINT = "system:mint"
FEES = "system:fees"
ESCROW = "system:escrow"
HOLDS = "system:holds"
OPERATOR = "system:operator"
SYSTEM_FLOORS: dict[str, int | None] = {MINT: None, FEES: None, ESCROW: 0, HOLDS: 0, OPERATOR: None}

# System accounts (the operator's key) rank ahead of every user; starvation stays bounded by
# PRIORITY_MAX_WAIT_SECONDS like for everyone else.
SYSTEM_STANDING = MAX_AMOUNT


def account_key(account_id: uuid.UUID | str) -> str:
    """The canonical text form of an account id (dict keys, lock order)."""
    return str(account_id if isinstance(account_id, uuid.UUID) else uuid.UUID(str(account_id)))


def earnings_total(*, account_id: AccountId) -> int:
    """Lifetime earnings from contributing (settlements and standby), escrowed ones included."""
    total = Posting.objects.filter(
        beneficiary_id=ids.as_uuid(account_id), entry__kind__in=EARNING_KINDS
    ).aggregate(s=Sum("amount"))["s"]
    return int(total or 0)


def earnings_since(*, account_ids: list[Any], since: datetime) -> dict[str, int]:
    """Earnings per account since ``since`` (only accounts that earned are present)."""
    rows = (
        Posting.objects.filter(
            beneficiary_id__in=account_ids,
            entry__kind__in=EARNING_KINDS,
            entry__created_at__gte=since,
        )
        .values("beneficiary_id")
        .annotate(s=Sum("amount"))
        .order_by()
    )
    return {account_key(r["beneficiary_id"]): int(r["s"] or 0) for r in rows}


def escrow_held(*, account_id: AccountId) -> int:
    """What system:escrow holds on behalf of ``account_id``."""
    total = Posting.objects.filter(
        account__name=ESCROW, beneficiary_id=ids.as_uuid(account_id)
    ).aggregate(s=Sum("amount"))["s"]
    return int(total or 0)


def job_hold(*, job_id: JobId) -> tuple[int, str | None]:
    """(amount held for the job, the account it was taken from), or (0, None) without a reservation."""
    held = 0
    consumer: str | None = None
    for p in Posting.objects.filter(entry__idempotency_key=f"reserve:{job_id}").select_related(
        "account"
    ):
        if p.account.name == HOLDS:
            held += p.amount
        else:
            consumer = account_key(p.account_id)
    return held, consumer


def open_holds(*, account_id: AccountId) -> int:
    """Credits of the account held for jobs not settled yet."""
    settled = Entry.objects.filter(kind=EntryKind.SETTLE, job_id=OuterRef("entry__job_id"))
    total = (
        Posting.objects.filter(account_id=account_id, entry__kind=EntryKind.RESERVE)
        .exclude(Exists(settled))
        .aggregate(s=Sum("amount"))["s"]
    )
    return -int(total or 0)


def account_standing(*, account_ids: list[Any], now: datetime | None = None) -> dict[Any, int]:
    """Queue standing per account: what it earned lending (job shares, standby pay) over the
    last CREDITS_STANDING_WINDOW_SECONDS (default a day), × CREDITS_STANDING_EARN_WEIGHT; system
    accounts (the operator's key) first. The balance does not count: a starting grant or a
    purchase buys no priority, lending does (README, "Priority").

    Keys are the ids as passed; an unknown id stands at 0.
    """
    now = now or timezone.now()
    keys = {a: account_key(a) for a in account_ids}
    window = settings.CREDITS_STANDING_WINDOW_SECONDS
    weight = settings.CREDITS_STANDING_EARN_WEIGHT
    rows = {
        account_key(r["id"]): r
        for r in Account.objects.filter(pk__in=set(keys.values())).values("id", "balance", "kind")
    }
    recent = earnings_since(account_ids=list(rows), since=now - timedelta(seconds=window))
    out: dict[Any, int] = {}
    for original, key in keys.items():
        row = rows.get(key)
        if row is None:
            out[original] = 0
        elif row["kind"] == AccountKind.SYSTEM:
            out[original] = SYSTEM_STANDING
        else:
            out[original] = weight * max(recent.get(key, 0), 0)
    return out


def account_summary(*, account_id: AccountId, now: datetime) -> dict[str, Any]:
    """Balance, what is free to spend, held, earned and escrowed for one account."""
    acct = Account.objects.get(pk=account_id)
    available = None if acct.floor is None else acct.balance - acct.floor
    window = settings.CREDITS_STANDING_WINDOW_SECONDS
    return {
        "account": acct,
        "balance": acct.balance,
        "floor": acct.floor,
        "available": available,
        "held": open_holds(account_id=ids.account_id(acct.pk)),
        "earned_total": earnings_total(account_id=ids.account_id(acct.pk)),
        "earned_recent": earnings_since(
            account_ids=[acct.pk], since=now - timedelta(seconds=window)
        ).get(account_key(acct.pk), 0),
        "escrow_held": escrow_held(account_id=ids.account_id(acct.pk)),
        "standing": (standing := account_standing(account_ids=[acct.pk], now=now)[acct.pk]),
        # Seconds a waiting request of this account is moved ahead (README, "Priority").
        "priority_seconds": round(priority_bonus(standing), 1),
    }


def ledger_postings(
    *,
    account_id: AccountId,
    kind: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[Posting]:
    """The account's postings, newest first, with their entries."""
    qs = Posting.objects.filter(account_id=account_id).select_related("entry")
    if kind:
        qs = qs.filter(entry__kind=kind)
    if since is not None:
        qs = qs.filter(entry__created_at__gte=since)
    if until is not None:
        qs = qs.filter(entry__created_at__lt=until)
    return qs.order_by("-entry__created_at", "-entry_id", "id")


def receipt_list(
    *,
    account_id: AccountId | None = None,
    job_id: JobId | None = None,
    node_id: NodeId | None = None,
) -> QuerySet[Receipt]:
    """Receipts, newest first: all of them, or those of nodes the account owns (or was paid for)."""
    qs = Receipt.objects.all()
    if account_id is not None:
        qs = qs.filter(Q(node__account_id=account_id) | Q(account_id=account_id))
    if job_id is not None:
        qs = qs.filter(job_id=job_id)
    if node_id is not None:
        qs = qs.filter(node_id=node_id)
    return qs.order_by("-issued_at", "id")


def key_usage(*, account_id: AccountId) -> list[dict[str, Any]]:
    """Per API key of the account: jobs, tokens, and the credits its jobs cost that account.

    ``credits`` is the net of the account's postings on those jobs' entries: the settled charge,
    plus the hold of any job not settled yet. Revoked keys are listed too (their usage stays).
    """
    keys = list(ApiKey.objects.filter(account_id=account_id).order_by("-created_at"))
    ids = [k.pk for k in keys]
    tokens: dict[Any, dict[str, Any]] = {
        row["api_key_id"]: dict(row)
        for row in Job.objects.filter(api_key_id__in=ids)
        .values("api_key_id")
        .annotate(
            jobs=Count("id"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
        )
    }
    spent = {
        row["entry__job__api_key_id"]: -int(row["s"] or 0)
        for row in Posting.objects.filter(
            entry__job__api_key_id__in=ids, account_id=F("entry__job__account_id")
        )
        .values("entry__job__api_key_id")
        .annotate(s=Sum("amount"))
    }
    out = []
    for k in keys:
        t: dict[str, Any] = tokens.get(k.pk, {})
        prompt, completion = int(t.get("prompt_tokens") or 0), int(t.get("completion_tokens") or 0)
        out.append(
            {
                "key": k.pk,
                "name": k.name,
                "prefix": k.prefix,
                "revoked": k.revoked_at is not None,
                "last_used_at": k.last_used_at,
                "jobs": int(t.get("jobs") or 0),
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "credits": spent.get(k.pk, 0),
            }
        )
    return out


def node_earnings(
    *,
    account_id: AccountId,
    days: int = 30,
    node_id: NodeId | None = None,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """Per node of the account and per day (UTC), newest first: credits earned, jobs served and
    receipts issued. A job's settlement is one ledger entry for all its nodes (no node on it), so
    a node's part of it is its receipt's credits (escrowed ones included, as in earnings_total);
    standby pay is the ledger's STANDBY postings, which name the node."""
    now = now or timezone.now()
    since = now - timedelta(days=days)
    standby = Posting.objects.filter(
        beneficiary_id=ids.as_uuid(account_id),
        entry__kind=EntryKind.STANDBY,
        entry__created_at__gte=since,
        entry__node__isnull=False,
    )
    issued = Receipt.objects.filter(account_id=account_id, issued_at__gte=since)
    if node_id is not None:
        standby = standby.filter(entry__node_id=node_id)
        issued = issued.filter(node_id=node_id)
    rows: dict[tuple[str, Any], dict[str, Any]] = {}

    def row(node: Any, name: str, day: Any) -> dict[str, Any]:
        key = (str(node), day)
        if key not in rows:
            rows[key] = {
                "node": str(node),
                "node_name": name,
                "day": day,
                "credits": 0,
                "jobs": 0,
                "receipts": 0,
            }
        return rows[key]

    for r in (
        standby.annotate(day=TruncDate("entry__created_at", tzinfo=UTC))
        .values("entry__node_id", "entry__node__name", "day")
        .annotate(s=Sum("amount"))
        .order_by()
    ):
        row(r["entry__node_id"], r["entry__node__name"], r["day"])["credits"] += int(r["s"] or 0)
    for i in (
        issued.annotate(day=TruncDate("issued_at", tzinfo=UTC))
        .values("node_id", "node__name", "day")
        .annotate(jobs=Count("job_id", distinct=True), receipts=Count("id"), s=Sum("credits"))
        .order_by()
    ):
        got = row(i["node_id"], i["node__name"], i["day"])
        got["credits"] += int(i["s"] or 0)
        got["jobs"] += int(i["jobs"])
        got["receipts"] += int(i["receipts"])
    return sorted(rows.values(), key=lambda x: (x["day"], x["node_name"]), reverse=True)
