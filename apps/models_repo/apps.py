from __future__ import annotations

from django.apps import AppConfig


class ModelsRepoConfig(AppConfig):
    name = "apps.models_repo"
    label = "models_repo"
    default_auto_field = "django.db.models.BigAutoField"
