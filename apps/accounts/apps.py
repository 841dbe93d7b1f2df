from __future__ import annotations

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    """Credit accounts and their API keys: the lowest app layer (every other app may import it)."""

    name = "apps.accounts"
    label = "accounts"
    default_auto_field = "django.db.models.BigAutoField"
