"""The drain of a node: its deployments move off it (deployments_drain_step, a node drain step).

The helpers that deployment_ensure, placement and a job's end share with it live in
deployments.py (the replacement) and jobs.py (drains_advance).
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db.models import Q

from racon import ids
from racon.celery import task_send_on_commit
from racon.ids import NodeId
from racon.locks import redis_lock

from . import kvcache, selectors
from .deployments import (
    deployment_stop,
    drain_replacement_locked,
    drain_replacement_recorded,
    ensure_lock_key,
)
from .models import Deployment, Job
from .states import (
    DEPLOYMENT_ACTIVE,
    DEPLOYMENT_PENDING,
    DEPLOYMENT_SERVING,
    JOB_IN_FLIGHT,
    JOB_OPEN,
)

# --- drain ------------------------------------------------------------------------------------
#
# A draining node (apps/nodes/services.py: node_drain, node_drain_advance) takes no new job:
# routing and deployment_ensure skip deployments with a draining member. Each of its serving
# deployments gets one replacement, placed on other nodes (DEPLOYMENT_MIGRATING names it); the old
# one keeps serving the jobs it already has, and is stopped once the replacement is READY (or has
# failed: no capacity elsewhere) and none of its own jobs is open. Once nothing is left on the
# node, the node is DRAINED. Each step is idempotent and runs again from a job's end, from a
# replacement becoming READY, and from the node's heartbeat.


def deployments_drain_step(*, node_id: NodeId, now: datetime) -> bool:
    """Move a draining node's deployments off it, stop those done; whether any work is still on it."""
    remaining = False
    deps = (
        Deployment.objects.filter(
            Q(nodes__id=node_id) | Q(primary_id=node_id), state__in=list(DEPLOYMENT_ACTIVE)
        )
        .distinct()
        .select_related("model")
    )
    for dep in deps:
        if dep.state in DEPLOYMENT_PENDING:
            remaining = True  # its placement re-plans without the draining node (_require_live)
            continue
        _kv_transfer_begin(dep)
        replacement = _drain_replacement(dep=dep, node_id=node_id, now=now)
        if replacement is not None and replacement.state in DEPLOYMENT_PENDING:
            remaining = True  # the old one serves its own jobs until the new one is READY
            continue
        if Job.objects.filter(deployment=dep, state__in=JOB_OPEN).exists():
            remaining = True  # running (and already queued) jobs finish where they are
            continue
        if kvcache.transfer_state(deployment_id=ids.deployment_id(dep.id)) == "moving":
            remaining = True  # its conversations' KV state is moving to another replica
            continue
        name = selectors.node_name(node_id)
        moved = replacement is not None and replacement.state in DEPLOYMENT_SERVING
        deployment_stop(
            deployment_id=ids.deployment_id(dep.id),
            now=now,
            reason=f"node {name} drained: moved to deployment {replacement.id}"
            if moved and replacement is not None
            else f"node {name} drained: no capacity elsewhere for a replacement",
        )
    return remaining or Job.objects.filter(nodes__id=node_id, state__in=JOB_IN_FLIGHT).exists()


def _kv_transfer_begin(dep: Deployment) -> None:
    """Start moving the conversations the replica's slots hold (once per replica; the task waits
    for its running jobs to end first). Routing waits for the move instead of dropping them, and
    the replica is stopped only once it is done (apps/jobs/kvtransfer.py)."""
    if dep.state not in DEPLOYMENT_SERVING or not kvcache.transfer_enabled():
        return
    held = len(kvcache.slots_held(deployment_id=ids.deployment_id(dep.id)))
    if not held:
        return
    step = float(settings.KV_TRANSFER_TIMEOUT_SECONDS)
    n = min(held, int(settings.KV_TRANSFER_MAX_CONVERSATIONS))
    # The mark outlives every step the task may wait for, and expires if the task is lost.
    if kvcache.transfer_begin(deployment_id=ids.deployment_id(dep.id), ttl=step * (1 + 2 * n) + 60):
        task_send_on_commit("racon.jobs.kv_transfer", deployment_id=str(dep.id))


def _drain_replacement(*, dep: Deployment, node_id: NodeId, now: datetime) -> Deployment | None:
    """The deployment that replaces ``dep`` off the draining node, created once (None: none can be)."""
    found, replacement = drain_replacement_recorded(dep)
    if found:
        return replacement
    # Under the model's ensure lock, like deployment_ensure: a first request arriving during the
    # drain and the drain itself make one replacement between them.
    with redis_lock(ensure_lock_key(ids.model_id(dep.model_id)), timeout=30):
        return drain_replacement_locked(dep=dep, node_id=node_id, now=now)
