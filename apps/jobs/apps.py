from __future__ import annotations

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "apps.jobs"
    label = "jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: they import models, which load only once the app
        # registry is ready (Django's AppConfig.ready idiom). Loading the tasks registers them,
        # so a task sent by name (racon.celery.task_send) runs eagerly under ALWAYS_EAGER.
        from . import (  # noqa: PLC0415
            receivers,
            tasks,  # noqa: F401
        )

        receivers.connect()
