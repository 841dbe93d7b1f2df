from __future__ import annotations

from django.contrib import admin

from .models import Deployment, Job


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ("id", "model", "state", "primary", "n_ctx", "created_at", "ready_at")
    list_filter = ("state", "model")


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "model",
        "state",
        "deployment",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "queued_at",
    )
    list_filter = ("state", "model", "finish_reason")
    date_hierarchy = "queued_at"
