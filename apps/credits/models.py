"""Credit accounts. The ledger (entries, postings, receipts) lives beside them."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class AccountKind(models.TextChoices):
    USER = "USER"
    ORG = "ORG"
    SYSTEM = "SYSTEM"


class Account(models.Model):
    """One per user or organisation, plus system accounts (mint, fees, escrow, operator)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=120, unique=True)
    kind = models.CharField(max_length=10, choices=AccountKind.choices, default=AccountKind.USER)
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="credit_account"
    )
    # Micro-credits. The cached balance is only ever changed in the same transaction as postings.
    balance = models.BigIntegerField(default=0)
    # The lowest balance spending may reach. None means unbounded (system accounts like mint).
    floor = models.BigIntegerField(null=True, blank=True, default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
