from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "apps.jobs"
    label = "jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from .models import Deployment

        # State changes go through deployment_transition (an .update(), which invalidates the
        # route cache itself); this covers saves elsewhere (admin, n_parallel edits).
        for signal in (post_save, post_delete):
            signal.connect(_deployment_changed, sender=Deployment, dispatch_uid=f"racon-cache-deployment-{signal is post_save}")


def _deployment_changed(**kwargs: Any) -> None:
    from racon import cache

    from .selectors import ROUTE_CACHE

    cache.invalidate(ROUTE_CACHE)
