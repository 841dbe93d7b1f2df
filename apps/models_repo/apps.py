from __future__ import annotations

from django.apps import AppConfig


class ModelsRepoConfig(AppConfig):
    name = "apps.models_repo"
    label = "models_repo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: it imports models, which load only once the app
        # registry is ready (Django's AppConfig.ready idiom).
        from . import receivers  # noqa: PLC0415

        receivers.connect()
