"""Bearer API keys: AI_API_KEY (operator bootstrap key) plus per-account keys stored hashed."""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Any, Literal

from django.conf import settings
from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.accounts import services as account_services
from apps.accounts.models import ApiKey
from apps.accounts.principal import KeyPrincipal
from apps.accounts.services import PRINCIPAL_CACHE, key_hash
from apps.credits.ledger import account_system
from racon import cache, ids
from racon.ids import AccountId, ApiKeyId

OPERATOR_ACCOUNT_NAME = "system:operator"
__all__ = ["PRINCIPAL_CACHE", "api_key_create", "api_key_revoke", "key_hash", "principal_for_key"]


def api_key_create(
    *,
    name: str,
    account_id: AccountId,
    scopes: list[str],
    user_id: int | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; returns it with the plaintext, shown once (apps.accounts.services.key_create)."""
    return account_services.key_create(
        name=name, account_id=account_id, scopes=scopes, user_id=user_id, expires_at=expires_at
    )


def api_key_revoke(*, key_id: ApiKeyId) -> ApiKey:
    """Revoke a key; every process stops accepting it once this commits (the principal cache)."""
    return account_services.key_revoke(key_id=key_id, now=timezone.now())


def operator_account_id() -> Any:
    return account_system(name=OPERATOR_ACCOUNT_NAME).id


def principal_for_key(raw: str, *, now: datetime | None = None) -> KeyPrincipal | None:
    """Resolve a bearer key, or None when it is unknown, revoked or expired (cached for
    API_CACHE_SECONDS; revocation clears the cache everywhere, expiry is checked on each use).

    A key that is let through is touched: its last_used_at moves at most once a minute.
    """
    if not raw:
        return None
    # The operator key's hash is part of the cache key: a changed AI_API_KEY is never served stale.
    principal = cache.cached(
        PRINCIPAL_CACHE,
        (key_hash(raw), key_hash(settings.AI_API_KEY or "")),
        lambda: _principal_load(raw),
    )
    if principal is None:
        return None
    now = now or timezone.now()
    if principal.expired(now=now):
        return None
    if principal.key_id is not None:
        account_services.key_touch(key_id=principal.key_id, now=now)
    return principal


def _principal_load(raw: str) -> KeyPrincipal | None:
    if settings.AI_API_KEY and hmac.compare_digest(raw.encode(), settings.AI_API_KEY.encode()):
        return KeyPrincipal(
            key_id=None,
            account_id=operator_account_id(),
            scopes=frozenset({ApiKey.SCOPE_INFERENCE, ApiKey.SCOPE_ADMIN}),
            is_operator_key=True,
        )
    key = (
        ApiKey.objects.select_related("user", "account__user")
        .filter(key_hash=key_hash(raw), revoked_at__isnull=True)
        .first()
    )
    if key is None:
        return None
    # A deactivated user's keys stop working: the key's own user's, and the account's user's.
    for user in (key.user, key.account.user):
        if user is not None and not user.is_active:
            return None
    expires_at = key_expiry_through_parents(key)
    if expires_at is False:
        return None
    return KeyPrincipal(
        key_id=ids.api_key_id(key.id),
        account_id=ids.account_id(key.account_id),
        scopes=frozenset(key.scopes),
        user=key.user,
        expires_at=expires_at,
        key_limits={f: getattr(key, f) for f in LIMIT_FIELDS},
        account_limits={f: getattr(key.account, f) for f in LIMIT_FIELDS},
    )


LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
PARENT_DEPTH_MAX = 32


def key_expiry_through_parents(key: ApiKey) -> datetime | None | Literal[False]:
    """The key's expiry, never later than any of its ancestors' (a child cannot outlive the key
    that made it); False when an ancestor is revoked or the chain is longer than any real one."""
    expires = key.expires_at
    parent_id = key.parent_id
    for _ in range(PARENT_DEPTH_MAX):
        if parent_id is None:
            return expires
        row = (
            ApiKey.objects.filter(pk=parent_id)
            .values("revoked_at", "expires_at", "parent_id")
            .first()
        )
        if row is None:
            return expires  # the parent was deleted: its limits went with it
        if row["revoked_at"] is not None:
            return False
        if row["expires_at"] is not None:
            expires = row["expires_at"] if expires is None else min(expires, row["expires_at"])
        parent_id = row["parent_id"]
    return False


def bearer_from_header(header: str) -> str:
    parts = header.split(None, 1)
    if len(parts) == 2 and parts[0].lower() == "bearer":
        return parts[1].strip()
    return ""


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """DRF authentication for `Authorization: Bearer <key>` (admin API and credits API)."""

    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header.lower().startswith("bearer "):
            return None
        principal = principal_for_key(bearer_from_header(header))
        if principal is None:
            raise exceptions.AuthenticationFailed("invalid API key")
        request._racon_principal = principal
        return (
            principal if principal.user is None else _UserWithPrincipal(principal.user, principal)
        ), principal

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="racon"'


class _UserWithPrincipal:
    """A real user seen through an API key: staff only if the user is staff or the key is admin."""

    def __init__(self, user: Any, principal: KeyPrincipal) -> None:
        self._user = user
        self.principal = principal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._user, name)

    @property
    def is_staff(self) -> bool:
        return self.principal.is_staff

    @property
    def is_authenticated(self) -> bool:
        return True
