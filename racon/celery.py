"""Celery application: placement, health sweeps, distribution, settlement."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.signals import beat_init, celeryd_init, worker_ready
from django.conf import settings
from django.db import transaction

from racon.redis import get_redis

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "racon.settings")

app = Celery("racon")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.task(name="racon.celery.ping", ignore_result=True)
def ping(**kwargs: object) -> None:
    """Beat sends this every few seconds; the worker marks itself alive for /health."""
    _mark_alive()


def _mark_alive() -> None:
    get_redis().set("racon:celery:alive", time.time(), ex=300)


@celeryd_init.connect
@beat_init.connect
def _lower_priority(**kwargs: object) -> None:
    """Background work yields the CPU to the engine and the request path (RACON_BACKGROUND_NICE).

    In the worker's main process before its pool forks (the pool inherits it) and in beat, so it
    holds however Celery is started: the launcher, the test harness, an operator's own command.
    Once per process tree: a beat embedded in a worker (``-B``) is forked already nicer.
    """
    if os.environ.get("RACON_BACKGROUND_NICED") == "1":
        return
    os.nice(settings.RACON_BACKGROUND_NICE)
    os.environ["RACON_BACKGROUND_NICED"] = "1"  # inherited by what this process forks


@worker_ready.connect
def _on_worker_ready(**kwargs: object) -> None:
    _mark_alive()


def task_send(name: str, /, **kwargs: Any) -> None:
    """Send a task by its registered name, so that no app imports another app's tasks module.

    ``signature`` finds the task in this process's registry (each app's ``ready`` loads its tasks),
    so CELERY_TASK_ALWAYS_EAGER runs it inline exactly like ``.delay()``; a task this process
    has not loaded goes to the broker by name.
    """
    app.signature(name, kwargs=kwargs).delay()


def task_send_later(name: str, /, *, countdown: float, **kwargs: Any) -> None:
    """``task_send``, run ``countdown`` seconds from now (inline at once when eager)."""
    app.signature(name, kwargs=kwargs).apply_async(countdown=countdown)


def task_send_on_commit(name: str, /, **kwargs: Any) -> None:
    """``task_send`` once the current transaction commits (Celery's ``delay_on_commit``)."""
    transaction.on_commit(lambda: task_send(name, **kwargs))
