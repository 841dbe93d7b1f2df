"""Accounts (one per user or organisation, plus the system accounts) and their API keys.

Both tables keep the names they had in the apps they came from (credits, api): the move to this
app was a state-only migration that kept every row.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class AccountKind(models.TextChoices):
    USER = "USER"
    ORG = "ORG"
    SYSTEM = "SYSTEM"


class Account(models.Model):
    """One per user or organisation, plus system accounts (mint, fees, escrow, holds, operator)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=120, unique=True)
    kind = models.CharField(max_length=10, choices=AccountKind.choices, default=AccountKind.USER)
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="credit_account",
    )
    # Micro-credits. The cached balance is only ever changed in the same transaction as postings
    # (apps.credits is its one writer).
    balance = models.BigIntegerField(default=0)
    # The lowest balance spending may reach. None means unbounded (system accounts like mint).
    floor = models.BigIntegerField(null=True, blank=True, default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    # Limits over all the account's keys together (apps.api.quotas), set by the operator.
    # None: the RATE_ACCOUNT_* setting; 0: no limit.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        db_table = "credits_account"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """A per-account bearer key, stored hashed (AI_API_KEY, the operator's key, is not stored).

    Scopes: ``inference`` calls /v1 (and reads the balance it spends); ``read`` reads the
    account's keys, usage and credits through REST; ``keys`` creates and revokes the account's
    keys; ``admin`` is the operator API (only for staff users, or keys the operator made).
    """

    SCOPE_INFERENCE = "inference"
    SCOPE_READ = "read"
    SCOPE_KEYS = "keys"
    SCOPE_ADMIN = "admin"
    SCOPES = (SCOPE_INFERENCE, SCOPE_READ, SCOPE_KEYS, SCOPE_ADMIN)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=120)
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="api_keys")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE
    )
    scopes = models.JSONField(
        default=list, help_text='subset of ["inference", "read", "keys", "admin"]'
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Written at most once a minute per key (apps.accounts.services.key_touch), never per request.
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The key that created this one (a `keys`-scope key): a child never outlives its parent, and
    # revoking the parent revokes its children.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    # Per-key limits (apps.api.quotas), set by the operator. None: the RATE_KEY_* setting; 0: no
    # limit.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        db_table = "api_apikey"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
