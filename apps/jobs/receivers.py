"""What the jobs app listens to and answers, connected once from ``JobsConfig.ready``."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save

from apps.nodes import hooks as node_hooks
from apps.nodes.states import DRAIN_STATES
from racon import cache
from racon.ids import NodeId

from .drain import deployments_drain_step
from .models import Deployment, Job
from .selectors import ROUTE_CACHE
from .states import JOB_IN_FLIGHT


def _deployment_changed(**kwargs: Any) -> None:
    cache.invalidate(ROUTE_CACHE)


def _node_state_moved(*, old: str, new: str, **kwargs: Any) -> None:
    # A node starting or ending a drain changes which deployments take new jobs.
    if old in DRAIN_STATES or new in DRAIN_STATES:
        cache.invalidate(ROUTE_CACHE)


def node_has_jobs_in_flight(*, node_id: NodeId) -> bool:
    """Whether a job still runs on the node (a drain ends once none does)."""
    return Job.objects.filter(nodes__id=node_id, state__in=JOB_IN_FLIGHT).exists()


def connect() -> None:
    # State changes go through deployment_transition (an .update(), which invalidates the
    # route cache itself); this covers saves elsewhere (admin, n_parallel edits).
    for signal in (post_save, post_delete):
        signal.connect(
            _deployment_changed,
            sender=Deployment,
            dispatch_uid=f"racon-cache-deployment-{signal is post_save}",
        )
    node_hooks.running_work_check_register(name="jobs", check=node_has_jobs_in_flight)
    node_hooks.drain_step_register(name="jobs", step=deployments_drain_step)
    node_hooks.node_state_moved.connect(
        _node_state_moved, dispatch_uid="racon-jobs-node-state-moved"
    )
