"""Reads for accounts and API keys (never a key's secret: only its prefix and hash are stored)."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Count, Q, QuerySet

from racon.ids import AccountId, ApiKeyId

from .models import Account, AccountKind, ApiKey


def key_status(key: ApiKey, *, now: datetime) -> str:
    """active, expired or revoked."""
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= now:
        return "expired"
    return "active"


def key_list(*, account_id: AccountId, include_revoked: bool = False) -> QuerySet[ApiKey]:
    """One account's keys, newest first; revoked ones only when asked for."""
    qs = ApiKey.objects.filter(account_id=account_id).select_related("user")
    return qs if include_revoked else qs.filter(revoked_at__isnull=True)


def key_get(*, key_id: ApiKeyId, account_id: AccountId | None) -> ApiKey:
    """One key; with an account, only if it belongs to it (ApiKey.DoesNotExist otherwise)."""
    qs = ApiKey.objects.select_related("user")
    if account_id is not None:
        qs = qs.filter(account_id=account_id)
    return qs.get(pk=key_id)


def account_list() -> QuerySet[Account]:
    """Contributor accounts (users and organisations, not the system ones) with key counts."""
    return (
        Account.objects.exclude(kind=AccountKind.SYSTEM)
        .select_related("user")
        .annotate(active_keys=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True)))
        .order_by("name")
    )
