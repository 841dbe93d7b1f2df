from __future__ import annotations

from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "apps.api"
    label = "api"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: they import models, which load only once the app
        # registry is ready (Django's AppConfig.ready idiom).
        from . import (  # noqa: PLC0415
            schema,  # noqa: F401 - registers the OpenAPI authentication extension
            signals,
        )

        signals.connect()
