"""The double-entry ledger over accounts (apps.accounts): entries, postings, signed receipts.

The ledger is append-only. ``Entry``, ``Posting`` and ``Receipt`` refuse updates and deletes at
the ORM level (a correction is a new entry); the only writer is ``ledger.ledger_post``.
"""

from __future__ import annotations

import uuid
from typing import Any, NoReturn

from django.db import models

from apps.accounts.models import Account


class EntryKind(models.TextChoices):
    """Who writes each kind: account_create and the admin API (GRANT, ADJUST), credit_reserve
    (RESERVE), credit_settle_job (SETTLE, ESCROW_RELEASE), credit_standby_reward (STANDBY)."""

    GRANT = "GRANT"
    ADJUST = "ADJUST"
    RESERVE = "RESERVE"
    SETTLE = "SETTLE"
    STANDBY = "STANDBY"
    ESCROW_RELEASE = "ESCROW_RELEASE"


# Entries whose beneficiary postings count as a contributor's earnings (standing, escrow trust).
EARNING_KINDS = (EntryKind.SETTLE, EntryKind.STANDBY)


class AppendOnlyError(Exception):
    """Raised on any attempt to change or remove a ledger row."""


class AppendOnlyQuerySet(models.QuerySet):
    def update(self, **kwargs: Any) -> NoReturn:
        raise AppendOnlyError(
            f"{self.model.__name__} rows are append-only; post a correcting entry"
        )

    def delete(self) -> NoReturn:
        raise AppendOnlyError(
            f"{self.model.__name__} rows are append-only; post a correcting entry"
        )


class AppendOnlyModel(models.Model):
    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AppendOnlyError(
                f"{type(self).__name__} rows are append-only; post a correcting entry"
            )
        kwargs["force_insert"] = True
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise AppendOnlyError(
            f"{type(self).__name__} rows are append-only; post a correcting entry"
        )


class Entry(AppendOnlyModel):
    """One balanced movement of credits. Its postings sum to zero; its key makes it happen once."""

    id = models.BigAutoField(primary_key=True)
    # Derived from what the entry settles ("settle:<job>", "reserve:<job>", "standby:<node>:<period>"):
    # the unique index is what makes a concurrent or retried second write a no-op.
    idempotency_key = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=16, choices=EntryKind.choices, db_index=True)
    memo = models.CharField(max_length=500, blank=True, help_text="reason, shown in the ledger")
    # PROTECT: a job or node with money attached to it is history, never deleted.
    job = models.ForeignKey(
        "jobs.Job", null=True, blank=True, on_delete=models.PROTECT, related_name="ledger_entries"
    )
    node = models.ForeignKey(
        "nodes.Node", null=True, blank=True, on_delete=models.PROTECT, related_name="ledger_entries"
    )
    data = models.JSONField(default=dict, blank=True, help_text="how the amounts were computed")
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "entries"
        indexes = [
            models.Index(fields=["kind", "node", "created_at"], name="credits_entry_kind_node")
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.idempotency_key}"


class Posting(AppendOnlyModel):
    """One leg of an entry: a signed amount on one account."""

    id = models.BigAutoField(primary_key=True)
    entry = models.ForeignKey(Entry, on_delete=models.PROTECT, related_name="postings")
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="postings")
    amount = models.BigIntegerField(help_text="micro-credits; positive credits the account")
    # The contributor whose earning this leg is, also while a system account (escrow) holds it.
    # Lifetime and recent earnings are sums over this column (standing, escrow trust).
    beneficiary = models.ForeignKey(
        Account,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="beneficiary_postings",
    )

    class Meta:
        ordering = ["-entry_id", "id"]
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(amount=0), name="credits_posting_amount_nonzero"
            )
        ]
        # The ledger page lists one account's postings newest first.
        indexes = [models.Index(fields=["account", "-entry"], name="credits_posting_account_entry")]

    def __str__(self) -> str:
        return f"{self.account_id} {self.amount:+d}"


class Receipt(AppendOnlyModel):
    """A signed statement, one per participating node per settlement, verifiable offline."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    entry = models.ForeignKey(Entry, on_delete=models.PROTECT, related_name="receipts")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="receipts")
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="receipts")
    account = models.ForeignKey(
        Account, on_delete=models.PROTECT, related_name="receipts", help_text="the node's owner"
    )
    model_name = models.CharField(max_length=200)
    tokens = models.PositiveIntegerField()
    layers = models.PositiveIntegerField()
    share_ppm = models.PositiveIntegerField(
        help_text="the node's part of the job's value, parts per million"
    )
    credits = models.BigIntegerField()
    escrowed = models.BooleanField(default=False)
    is_primary = models.BooleanField(default=False)
    issued_at = models.DateTimeField(db_index=True)
    # Exactly the signed document (canonical JSON of it is what the signature covers).
    payload = models.JSONField()
    signature = models.CharField(max_length=200)
    key_id = models.CharField(max_length=32)

    class Meta:
        ordering = ["-issued_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "node"], name="credits_one_receipt_per_job_node")
        ]

    def __str__(self) -> str:
        return f"receipt {self.job_id} {self.node_id} {self.credits}"

    def document(self) -> dict[str, Any]:
        """The receipt as handed out and verified: the signed payload plus its signature."""
        return {**self.payload, "signature": self.signature}
