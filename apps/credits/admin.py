"""Django admin for credits. The ledger is append-only: entries, postings and receipts are read-only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from apps.accounts.models import Account

from .ledger import account_create
from .models import Entry, Posting, Receipt


class ReadOnlyAdmin(admin.ModelAdmin):
    """Append-only rows: viewable, never added, changed or deleted here (a correction is a new entry)."""

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


class PostingInline(admin.TabularInline):
    model = Posting
    fk_name = "entry"
    fields = ("account", "amount", "beneficiary")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "user", "balance", "floor", "created_at")
    list_filter = ("kind",)
    search_fields = ("name",)
    readonly_fields = ("balance",)

    def save_model(self, request: Any, obj: Account, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        # New accounts go through the service so they get their starting grant like any other.
        created = account_create(name=obj.name, user_id=obj.user_id, kind=obj.kind)
        if obj.floor != created.floor:
            Account.objects.filter(pk=created.pk).update(floor=obj.floor)
        obj.pk = created.pk
        obj.refresh_from_db()

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False  # postings reference accounts (PROTECT); a closed account keeps its history


@admin.register(Entry)
class EntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "idempotency_key", "memo", "job", "node", "created_at")
    list_filter = ("kind",)
    search_fields = ("idempotency_key", "memo")
    date_hierarchy = "created_at"
    inlines = [PostingInline]


@admin.register(Posting)
class PostingAdmin(ReadOnlyAdmin):
    list_display = ("id", "entry", "account", "amount", "beneficiary")
    list_filter = ("entry__kind",)
    search_fields = ("account__name", "entry__idempotency_key")
    list_select_related = ("entry", "account", "beneficiary")


@admin.register(Receipt)
class ReceiptAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "job",
        "node",
        "account",
        "model_name",
        "tokens",
        "layers",
        "credits",
        "escrowed",
        "issued_at",
    )
    list_filter = ("escrowed", "is_primary")
    search_fields = ("job__id", "node__name", "model_name")
    list_select_related = ("node", "account")
