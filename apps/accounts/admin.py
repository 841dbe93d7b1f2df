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
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
    )
    list_filter = ("revoked_at",)
    # Limits: empty takes the RATE_KEY_* setting, 0 is no limit (apps/api/quotas.py).
    readonly_fields = ("prefix", "key_hash", "parent")
