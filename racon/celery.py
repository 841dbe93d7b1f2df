"""Celery application: placement, health sweeps, distribution, settlement."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "racon.settings")

app = Celery("racon")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.task(name="racon.celery.ping", ignore_result=True)
def ping(**kwargs: object) -> None:
    """Beat sends this every few seconds; the worker marks itself alive for /health."""
    _mark_alive()


def _mark_alive() -> None:
    import time

    from racon.redis import get_redis

    get_redis().set("racon:celery:alive", time.time(), ex=300)


from celery.signals import worker_ready  # noqa: E402


@worker_ready.connect
def _on_worker_ready(**kwargs: object) -> None:
    _mark_alive()
