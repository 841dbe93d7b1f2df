"""Celery entry points for jobs and deployments. Thin: one call into services each."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils import timezone


@shared_task(name="racon.jobs.node_state_changed", ignore_result=True)
def node_state_changed(*, node_id: str, state: str, **kwargs: Any) -> None:
    """React to a member node's health change (deployments degrade, fail and get replaced)."""
    from . import services

    services.deployments_on_node_state(node_id=node_id, state=state, now=timezone.now())
    if state == "READY":
        services.links_probe_request(node_id=node_id)


@shared_task(name="racon.jobs.place_deployment", ignore_result=True)
def place_deployment(*, deployment_id: str, **kwargs: Any) -> None:
    """Plan, load and confirm a deployment (idempotent: only a PLANNING deployment is placed)."""
    from . import services

    services.deployment_place(deployment_id=deployment_id)


@shared_task(name="racon.jobs.stale_jobs_sweep", ignore_result=True)
def stale_jobs_sweep(**kwargs: Any) -> dict[str, int]:
    """Fail or finish jobs left non-terminal (beat: every 30 s)."""
    from . import services

    return services.jobs_fail_stale(now=timezone.now())


@shared_task(name="racon.jobs.autoscale", ignore_result=True)
def autoscale(**kwargs: Any) -> dict[str, Any]:
    """Replicas follow load: one more under sustained queueing, idle added ones stopped (beat)."""
    from .autoscale import replicas_autoscale

    return replicas_autoscale(now=timezone.now()).to_dict()


@shared_task(name="racon.jobs.admission_sweep", ignore_result=True)
def admission_sweep(**kwargs: Any) -> dict[str, int]:
    """Reclaim slot leases and queue entries that crashed views left (beat: every 15 s)."""
    from . import admission

    return admission.admission_sweep(now=timezone.now())
