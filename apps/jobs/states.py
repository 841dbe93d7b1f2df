"""Job and deployment states with their transition tables. Pure: no ORM."""

from __future__ import annotations

from django.db import models


class JobState(models.TextChoices):
    """Owners: the API view (QUEUED, CANCELLED by a client), the dispatcher (DISPATCHED), the
    stream reader or the agent's report (RUNNING, COMPLETED, FAILED), the operator (CANCELLED)."""

    QUEUED = "QUEUED"
    DISPATCHED = "DISPATCHED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


J = JobState
# Named groups: every caller uses these instead of writing states out by hand.
JOB_TERMINAL = frozenset({J.COMPLETED, J.FAILED, J.CANCELLED})
JOB_OPEN = frozenset({J.QUEUED, J.DISPATCHED, J.RUNNING})  # not terminal yet
JOB_IN_FLIGHT = frozenset({J.DISPATCHED, J.RUNNING})  # on a node: holds a slot, keeps a drain open
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    J.QUEUED: frozenset({J.DISPATCHED, J.FAILED, J.CANCELLED}),
    J.DISPATCHED: frozenset({J.RUNNING, J.COMPLETED, J.FAILED, J.CANCELLED}),
    J.RUNNING: frozenset({J.COMPLETED, J.FAILED, J.CANCELLED}),
    J.COMPLETED: frozenset(),
    J.FAILED: frozenset(),
    J.CANCELLED: frozenset(),
}


class DeploymentState(models.TextChoices):
    """Owners: the placement task (PLANNING → LOADING → READY | FAILED), the health sweep and
    node transitions (DEGRADED, FAILED), the operator (STOPPED)."""

    PLANNING = "PLANNING"
    LOADING = "LOADING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


D = DeploymentState
DEPLOYMENT_PENDING = frozenset({D.PLANNING, D.LOADING})  # being placed or loaded
DEPLOYMENT_SERVING = frozenset({D.READY, D.DEGRADED})  # takes jobs
DEPLOYMENT_ACTIVE = DEPLOYMENT_PENDING | DEPLOYMENT_SERVING
DEPLOYMENT_ENDED = frozenset({D.FAILED, D.STOPPED})  # will never serve again
DEPLOYMENT_TRANSITIONS: dict[str, frozenset[str]] = {
    D.PLANNING: frozenset({D.PLANNING, D.LOADING, D.FAILED, D.STOPPED}),
    D.LOADING: frozenset({D.PLANNING, D.READY, D.FAILED, D.STOPPED}),
    D.READY: frozenset({D.DEGRADED, D.FAILED, D.STOPPED}),
    D.DEGRADED: frozenset({D.READY, D.FAILED, D.STOPPED}),
    D.FAILED: frozenset({D.STOPPED}),
    D.STOPPED: frozenset(),
}
