from __future__ import annotations

from django.apps import AppConfig


class CreditsConfig(AppConfig):
    name = "apps.credits"
    label = "credits"
    default_auto_field = "django.db.models.BigAutoField"
