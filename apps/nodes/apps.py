from __future__ import annotations

from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from racon.lan import controller_redis_refusal


class NodesConfig(AppConfig):
    name = "apps.nodes"
    label = "nodes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Loading the tasks registers them, so a task sent by name (racon.celery.task_send)
        # runs eagerly under ALWAYS_EAGER. Here, not at the top: they import models. Loading
        # schema registers the enrollment body's rules with drf-spectacular (its extensions).
        from . import schema, tasks  # noqa: F401, PLC0415

        _refuse_unsafe_redis()


def _refuse_unsafe_redis() -> None:
    """The controller refuses to start with an external Redis on a non-loopback address that is
    not TLS, or whose `default` user needs no password (issue 24; the launcher checks the same).
    Loopback (CI's 127.0.0.1:6379, the embedded one) costs nothing: no connection is made."""
    urls = {
        "REDIS_URL": settings.REDIS_URL,
        "RACON_AGENT_REDIS_URL": settings.AGENT_REDIS_URL,
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
    }
    # One check per URL: the broker and the agents' URL default to REDIS_URL.
    unique: dict[str, str] = {}
    for name, url in urls.items():
        if url not in unique.values():
            unique[name] = url
    refusal = controller_redis_refusal(
        unique, insecure_lan=bool(settings.INSECURE_LAN), ca_file=settings.TLS_CA_FILE or None
    )
    if refusal:
        raise ImproperlyConfigured(f"the controller refuses to start: {refusal}")
