"""Django admin for API keys. AccountAdmin lives in apps/credits/admin.py: a new account gets its
starting grant through the ledger (credits.ledger.account_create), a layer above this app."""

from __future__ import annotations

from django.contrib import admin

from .models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "prefix",
        "account",
        "user",
        "scopes",
        "created_at",
        "revoked_at",
        "last_used_at",
    )
    list_filter = ("revoked_at",)
    readonly_fields = ("prefix", "key_hash")
