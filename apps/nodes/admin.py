from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from .models import EnrollmentToken, Event, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "state",
        "address",
        "account",
        "cpu_logical_cores",
        "ram_total",
        "vram_total",
        "drain_requested",
        "enrolled_at",
    )
    list_filter = ("state", "drain_requested", "account")
    search_fields = ("name", "machine_id", "address")
    readonly_fields = (
        "id",
        "machine_id",
        "credential_hash",
        "state",
        "state_changed_at",
        "hardware",
        "enrolled_at",
    )


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(admin.ModelAdmin):
    list_display = ("label", "prefix", "account", "uses", "max_uses", "expires_at", "revoked_at")
    list_filter = ("account",)
    readonly_fields = ("token_hash", "prefix", "uses")


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    list_display = (
        "created_at",
        "kind",
        "category",
        "node",
        "job",
        "deployment",
        "old_state",
        "new_state",
        "message",
    )
    list_filter = ("category", "kind")
    search_fields = ("message",)
    date_hierarchy = "created_at"

    def has_change_permission(self, request: HttpRequest, obj: Event | None = None) -> bool:
        return False  # append-only

    def has_delete_permission(self, request: HttpRequest, obj: Event | None = None) -> bool:
        return False
