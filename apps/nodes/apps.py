from __future__ import annotations

from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "apps.nodes"
    label = "nodes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Loading the tasks registers them, so a task sent by name (racon.celery.task_send)
        # runs eagerly under ALWAYS_EAGER. Here, not at the top: they import models. Loading
        # schema registers the enrollment body's rules with drf-spectacular (its extensions).
        from . import schema, tasks  # noqa: F401, PLC0415
