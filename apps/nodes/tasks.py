"""Celery entry points for the node registry."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils import timezone

from .events import events_prune as _events_prune
from .redis_bounds import nodes_redis_bound_check
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


@shared_task(name="racon.nodes.events_prune", ignore_result=True)
def events_prune(**kwargs: Any) -> int:
    """Delete event rows older than EVENT_RETENTION_DAYS (beat: hourly)."""
    return _events_prune(now=timezone.now())


@shared_task(name="racon.nodes.redis_bound_check", ignore_result=True)
def redis_bound_check(**kwargs: Any) -> list[str]:
    """Revoke nodes whose own Redis keys hold more than NODE_MAX_REDIS_BYTES (beat:
    NODE_REDIS_CHECK_SECONDS)."""
    return nodes_redis_bound_check(now=timezone.now())
