"""Celery entry points for the node registry."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils import timezone

from .services import node_health_sweep


@shared_task(name="racon.nodes.health_sweep", ignore_result=True)
def health_sweep(**kwargs: Any) -> dict[str, int]:
    """Apply heartbeat thresholds to every watched node (beat: HEALTH_SWEEP_SECONDS)."""
    result = node_health_sweep(now=timezone.now())
    return {
        "degraded": len(result.degraded),
        "offline": len(result.offline),
        "suppressed": len(result.suppressed),
    }
