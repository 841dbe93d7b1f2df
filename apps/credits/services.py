"""Credit accounts (the ledger's writes are added beside these)."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from .models import Account, AccountKind


def account_system(*, name: str) -> Account:
    """Get or create a system account (unbounded floor)."""
    acct = Account.objects.filter(name=name).first()
    if acct is not None:
        return acct
    try:
        with transaction.atomic():
            return Account.objects.create(name=name, kind=AccountKind.SYSTEM, floor=None)
    except IntegrityError:
        return Account.objects.get(name=name)


def account_for_user(*, user: Any) -> Account:
    """The user's own account, created on first use."""
    acct = Account.objects.filter(user=user).first()
    if acct is not None:
        return acct
    return account_create(name=f"user:{user.get_username()}", user_id=user.pk)


def account_create(*, name: str, user_id: Any = None, kind: str = AccountKind.USER) -> Account:
    """Create a user or organisation account."""
    return Account.objects.create(name=name, user_id=user_id, kind=kind)
