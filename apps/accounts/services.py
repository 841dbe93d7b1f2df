"""Writes for contributor accounts (users, invites) and their API keys.

A new account's starting grant is posted by the credits ledger, a layer above this app: creating
a user here asks the registered user-account provider (``principal.user_account``, set by
apps.credits at start-up) for the user's account, which posts the grant in the same transaction.

Key revocation and creation clear the API-key principal cache in every process (racon/cache.py):
this process at once, the others when the transaction commits (pub/sub), so a revoked key is
refused everywhere within moments, and within API_CACHE_SECONDS even if the message is lost.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import (
    MinimumLengthValidator,
    get_default_password_validators,
    validate_password,
)
from django.contrib.auth.tokens import default_token_generator
from django.db import IntegrityError, transaction
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_decode, urlsafe_base64_encode

from racon import cache
from racon.ids import AccountId, ApiKeyId, as_uuid
from racon.redis import get_redis

from .models import Account, ApiKey
from .principal import user_account

log = logging.getLogger("racon.accounts")

PRINCIPAL_CACHE = "principal"  # racon/cache.py: cleared by every ApiKey write
KEY_PREFIX = "rk_"
# last_used_at is written at most once per key per TOUCH_INTERVAL across all processes: first a
# per-process check (no I/O), then a Redis SET NX shared by every process, then one UPDATE.
TOUCH_INTERVAL = timedelta(seconds=60)
_touched: dict[Any, datetime] = {}
_touched_lock = threading.Lock()


class InviteInvalid(ValueError):
    """The invite link is unknown, used already (the password was set), or expired."""


class UsernameTaken(ValueError):
    """A user with this username exists already (the REST API answers 409 username_taken)."""

    code = "username_taken"
    field = "username"


@dataclass(frozen=True)
class AccountCreated:
    account: Account
    user: Any
    # "<uidb64>/<token>" for the set-password page; None when the account got a password.
    invite: str | None


def key_hash(key: str) -> str:
    # The keys are 256 random bits: a plain SHA-256 is enough (no dictionary to defend against).
    return hashlib.sha256(key.encode()).hexdigest()


def key_create(
    *,
    name: str,
    account_id: AccountId,
    scopes: list[str],
    user_id: int | None = None,
    expires_at: datetime | None = None,
    now: datetime | None = None,
    parent_id: ApiKeyId | None = None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its plaintext, which is shown once and never stored.

    ``parent_id`` is the key that asked for this one: the new key expires no later than it, and
    is revoked with it (ValueError for an expiry past the parent's)."""
    unknown = set(scopes) - set(ApiKey.SCOPES)
    if unknown or not scopes:
        raise ValueError(
            f"scopes must be a non-empty subset of {list(ApiKey.SCOPES)}, got {sorted(scopes)!r}"
        )
    if ApiKey.SCOPE_ADMIN in scopes and user_id is not None:
        user = get_user_model().objects.filter(pk=user_id).first()
        if user is None or not user.is_staff:
            raise ValueError("only an operator (a staff user) may hold an admin-scoped key")
    if expires_at is not None and now is not None and expires_at <= now:
        raise ValueError("expires_at must be in the future")
    if parent_id is not None:
        parent = ApiKey.objects.get(pk=parent_id)
        if parent.expires_at is not None:
            if expires_at is None:
                expires_at = parent.expires_at  # never-expiring from an expiring key: its expiry
            elif expires_at > parent.expires_at:
                raise ValueError(
                    "a key cannot outlive the key that creates it: expires_at must be at or "
                    f"before {parent.expires_at.isoformat()}"
                )
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        name=name[:120],
        prefix=plaintext[:8],
        key_hash=key_hash(plaintext),
        account_id=account_id,
        scopes=sorted(set(scopes)),
        user_id=user_id,
        expires_at=expires_at,
        parent_id=parent_id,
    )
    return key, plaintext  # the post_save signal (apps.api.signals) clears the principal cache


def key_revoke(*, key_id: ApiKeyId, now: datetime) -> ApiKey:
    """Revoke a key and the keys it made, theirs too (idempotent); every process refuses them
    once this commits."""
    ids = {as_uuid(key_id)}
    frontier = [as_uuid(key_id)]
    while frontier:
        frontier = [
            k
            for k in ApiKey.objects.filter(parent_id__in=frontier).values_list("pk", flat=True)
            if k not in ids
        ]
        ids.update(frontier)
    ApiKey.objects.filter(pk__in=ids, revoked_at__isnull=True).update(revoked_at=now)
    cache.invalidate(PRINCIPAL_CACHE)  # .update() sends no signal
    return ApiKey.objects.get(pk=key_id)


def limits_set(*, obj: Account | ApiKey, limits: dict[str, int | None]) -> None:
    """Set a key's or an account's /v1 limits (the fields given; None: the setting's default,
    0: none); every process applies them within moments (the principal cache is cleared)."""
    fields = [
        f for f in ("requests_per_minute", "tokens_per_minute", "max_concurrent") if f in limits
    ]
    if not fields:
        return
    for f in fields:
        setattr(obj, f, limits[f])
    obj.save(update_fields=fields)
    cache.invalidate(PRINCIPAL_CACHE)


def key_touch(*, key_id: ApiKeyId, now: datetime) -> bool:
    """Record that a key was used: at most one write per key per minute in the whole cluster.

    Steady use costs no I/O at all in this process, and one Redis round trip a minute per key.
    Never raises: a lost touch only makes last_used_at a little older.
    """
    if key_id is None:
        return False
    with _touched_lock:
        last = _touched.get(key_id)
        if last is not None and now - last < TOUCH_INTERVAL:
            return False
        _touched[key_id] = now
        if len(_touched) > 65536:  # bounded: forget the oldest half
            for k in sorted(_touched, key=_touched.__getitem__)[: len(_touched) // 2]:
                del _touched[k]
    try:
        if not get_redis().set(
            f"racon:apikey:{key_id}:touched",
            "1",
            nx=True,
            ex=int(TOUCH_INTERVAL.total_seconds()),
        ):
            return False  # another process wrote it within the minute
    except redis.RedisError:
        log.warning("key touch throttle unavailable; last_used_at not updated", exc_info=True)
        return False
    ApiKey.objects.filter(pk=key_id).update(last_used_at=now)
    return True


def key_touch_forget() -> None:
    """Forget this process's touch times (tests that move the clock)."""
    with _touched_lock:
        _touched.clear()


# --- accounts and invites -------------------------------------------------------------------------


def account_user_create(
    *, username: str, email: str = "", password: str | None = None, is_staff: bool = False
) -> AccountCreated:
    """Create a user and their account (with its starting grant) in one transaction.

    Without a password the user cannot sign in until they follow the returned one-time invite.
    """
    User = get_user_model()
    taken = UsernameTaken(f"a user named {username!r} exists already")
    if User.objects.filter(username=username).exists():
        raise taken
    user = User(username=username, email=email, is_staff=is_staff)
    if password:
        validate_password(password, user)
        user.set_password(password)
    else:
        user.set_unusable_password()
    try:
        with transaction.atomic():
            user.save()
            account = user_account(user=user)
    except IntegrityError as exc:  # created by a concurrent request since the check above
        if User.objects.filter(username=username).exists():
            raise taken from exc
        raise
    return AccountCreated(
        account=account, user=user, invite=None if password else invite_issue(user=user)
    )


def password_min_length() -> int:
    """The shortest password AUTH_PASSWORD_VALIDATORS allow (0: no MinimumLengthValidator)."""
    return max(
        (
            v.min_length
            for v in get_default_password_validators()
            if isinstance(v, MinimumLengthValidator)
        ),
        default=0,
    )


def invite_issue(*, user: Any) -> str:
    """A one-time set-password link path, "<uidb64>/<token>" (Django's password-reset token).

    It stops working once the password is set (the token hashes the password), or after
    PASSWORD_RESET_TIMEOUT.
    """
    return (
        f"{urlsafe_base64_encode(force_bytes(user.pk))}/{default_token_generator.make_token(user)}"
    )


def invite_user(*, uidb64: str, token: str) -> Any:
    """The user an invite is for (InviteInvalid if it is not valid any more)."""
    try:
        pk = urlsafe_base64_decode(uidb64).decode()
        user = get_user_model().objects.get(pk=pk)
    except (ValueError, TypeError, OverflowError, get_user_model().DoesNotExist) as exc:
        raise InviteInvalid("this invite link is not valid") from exc
    if not default_token_generator.check_token(user, token):
        raise InviteInvalid("this invite link was used already or has expired")
    return user


def invite_accept(*, uidb64: str, token: str, password: str) -> Any:
    """Set the invited user's password; the link cannot be used again afterwards."""
    user = invite_user(uidb64=uidb64, token=token)
    validate_password(password, user)
    user.set_password(password)
    user.save(update_fields=["password"])
    return user
