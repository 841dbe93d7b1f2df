from __future__ import annotations

from django.contrib import admin

from .models import Account


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "user", "balance", "floor", "created_at")
    list_filter = ("kind",)
    search_fields = ("name",)
    readonly_fields = ("balance",)
