"""Who a request acts for: the bearer key's principal, or the signed-in user's account.

The key check itself (hashing, the operator's AI_API_KEY, the cache) is apps.api.auth. A user's
own account is found or created by the credits app (with its starting grant on first use), a layer
above this one: it registers that function here at start-up (``user_account_provide``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from racon.ids import AccountId, ApiKeyId

from .models import Account, ApiKey

UserAccount = Callable[..., Account]  # (*, user) -> Account
_providers: dict[str, UserAccount] = {}


@dataclass
class KeyPrincipal:
    """Who a bearer key speaks for. Stands in for request.user on API-key requests."""

    key_id: ApiKeyId | None
    account_id: AccountId
    scopes: frozenset[str]
    user: Any = None
    is_operator_key: bool = False
    is_authenticated: bool = True
    # Checked on every use, not when the principal is loaded: a cached principal must not outlive
    # its key's expiry by up to API_CACHE_SECONDS.
    expires_at: datetime | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The operator's limits (apps.api.quotas): requests_per_minute, tokens_per_minute,
    # max_concurrent; a value None takes the RATE_KEY_* / RATE_ACCOUNT_* setting, 0 is no limit.
    key_limits: dict[str, int | None] = field(default_factory=dict)
    account_limits: dict[str, int | None] = field(default_factory=dict)

    @property
    def is_staff(self) -> bool:
        """A key's rights are its scopes, bounded by its user's: a staff user's inference key is
        not an admin key, and an admin-scoped key of a user who is no longer staff is not either."""
        if ApiKey.SCOPE_ADMIN not in self.scopes:
            return False
        return self.user is None or bool(getattr(self.user, "is_staff", False))

    def has_scope(self, scope: str) -> bool:
        """Whether the key may act in this scope (an admin key may do everything)."""
        return scope in self.scopes or self.is_staff

    def expired(self, *, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    @property
    def pk(self) -> Any:
        return getattr(self.user, "pk", None)


def user_account_provide(provider: UserAccount) -> None:
    """Set the function that finds or creates a user's own account (apps.credits, at ready())."""
    _providers["user"] = provider


def user_account(*, user: Any) -> Account:
    """The user's own account, found or created (with its starting grant) by the provider."""
    provider = _providers.get("user")
    if provider is None:
        raise RuntimeError("no user-account provider registered (apps.credits is not installed)")
    return provider(user=user)


def request_principal(request: Any) -> KeyPrincipal | None:
    """The bearer key's principal when the request came with one (None for a session)."""
    principal = getattr(request, "_racon_principal", None) or getattr(request, "auth", None)
    return principal if isinstance(principal, KeyPrincipal) else None


def request_account_id(request: Any) -> Any:
    """The credit account a request acts for: the key's account, or the session user's."""
    principal = getattr(request, "_racon_principal", None) or getattr(request, "auth", None)
    if isinstance(principal, KeyPrincipal):
        return principal.account_id
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return user_account(user=user).id
    return None
