"""Replicas follow load: one more deployment of a model under sustained queueing, idle extras stopped.

One pass (``replicas_autoscale``, beat ``racon.jobs.autoscale`` every REPLICA_AUTOSCALE_SECONDS)
looks at every model with an active deployment:

- **Up.** The model is under pressure when its queue wait (admission's EWMA) is above
  REPLICA_SCALE_UP_WAIT_SECONDS while someone is waiting (or joined a queue since the last pass:
  the EWMA alone decays slowly after the queue drained). Once under pressure for
  REPLICA_SCALE_UP_SUSTAIN_SECONDS, with no replica of the model still PLANNING or LOADING and
  fewer than REPLICA_MAX_PER_MODEL active, a copy is placed on a node that serves none of the
  model (the scheduler's one-replica-per-node rule; the preview says whether one can host it).
  Event REPLICA_ADDED on the new deployment. The pressure clock restarts after each addition.
- **Down.** A replica this autoscaler added (its REPLICA_ADDED event), serving, with no slot in use
  and nobody waiting for the model, for REPLICA_IDLE_SECONDS, is stopped: REPLICA_REMOVED. Never
  the model's last serving replica, never while the model is under pressure, one per pass.
  Replicas an operator placed are the operator's to stop.

State, owned here: HASH ``racon:autoscale:{model}`` with ``above_since`` (start of the current
pressure run) and ``idle:{deployment}`` (when that replica was first seen idle), unix seconds of
the injected clock. A pass runs under ``racon:lock:autoscale`` so two beats never both add.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from apps.models_repo.models import Model
from apps.nodes.events import event_record
from apps.nodes.models import Event, EventCategory
from racon import ids
from racon.ids import ModelId, NodeId
from racon.redis import get_redis

from . import admission, selectors
from .deployments import (
    deployment_create,
    deployment_preview,
    deployment_stop,
    engine_model_file,
    placement_request_from,
)
from .models import Deployment
from .scheduler import PlacementRefused, PlacementRequest
from .states import DEPLOYMENT_ACTIVE, DEPLOYMENT_PENDING, DEPLOYMENT_SERVING

log = logging.getLogger("racon.jobs.autoscale")

AUTOSCALE_LOCK_KEY = "racon:lock:autoscale"
_STATE_TTL_SECONDS = 86_400


def autoscale_key(model_id: ModelId) -> str:
    return f"racon:autoscale:{model_id}"


@dataclass
class AutoscaleReport:
    """What one pass did, per model name: the deployments added and removed, and why not."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def replicas_autoscale(*, now: datetime) -> AutoscaleReport:
    """One pass: at most one replica added or removed per model; a pass already running is skipped."""
    report = AutoscaleReport()
    lock = get_redis().lock(AUTOSCALE_LOCK_KEY, timeout=120, blocking=False)
    if not lock.acquire():
        return report
    try:
        model_ids = (
            Deployment.objects.filter(state__in=list(DEPLOYMENT_ACTIVE))
            .values_list("model_id", flat=True)
            .distinct()
        )
        for model in Model.objects.filter(pk__in=list(model_ids)).order_by("name"):
            try:
                _autoscale_model(model=model, now=now, report=report)
            except Exception:  # one model's fault must not stop the others
                log.exception("autoscaling %s failed", model.name)
    finally:
        try:
            lock.release()
        except Exception:  # expired meanwhile; nothing of ours to release
            pass
    return report


def _autoscale_model(*, model: Model, now: datetime, report: AutoscaleReport) -> None:
    t = now.timestamp()
    r = get_redis()
    key = autoscale_key(ids.model_id(model.id))
    deps = list(
        Deployment.objects.filter(model=model, state__in=list(DEPLOYMENT_ACTIVE)).order_by(
            "created_at"
        )
    )
    serving = [d for d in deps if d.state in DEPLOYMENT_SERVING]
    dep_ids = [str(d.id) for d in deps]
    waiting = admission.queue_depth(dep_ids, now=t)
    in_use = admission.slots_in_use(dep_ids, now=t)
    depth = sum(waiting.values())
    wait = admission.model_queue_wait(ids.model_id(model.id), now=t)
    last_queued = admission.model_last_queued(ids.model_id(model.id))
    period = float(settings.REPLICA_AUTOSCALE_SECONDS)
    recently_queued = last_queued is not None and t - last_queued <= 2 * period
    pressure = wait > float(settings.REPLICA_SCALE_UP_WAIT_SECONDS) and (
        depth > 0 or recently_queued
    )
    state = r.hgetall(key)
    with r.pipeline(transaction=False) as pipe:
        # Idle markers of replicas that are gone, and every one while the model is under
        # pressure: idleness counts from the end of the last queueing, never across it.
        stale = [f for f in state if f.startswith("idle:") and (pressure or f[5:] not in dep_ids)]
        if stale:
            pipe.hdel(key, *stale)
        if not pressure and "above_since" in state:
            pipe.hdel(key, "above_since")
        elif pressure and "above_since" not in state:
            pipe.hset(key, "above_since", repr(t))
        pipe.expire(key, _STATE_TTL_SECONDS)
        pipe.execute()

    if pressure:
        since = float(state.get("above_since") or t)
        if t - since < float(settings.REPLICA_SCALE_UP_SUSTAIN_SECONDS):
            return
        why = _scale_up_blocked(deps=deps)
        if why is None:
            added, why = _replica_add(model=model, serving=serving, now=now, wait=wait, depth=depth)
            if added is not None:
                r.hdel(key, "above_since")
                report.added.append(str(added.id))
                return
        report.blocked[model.name] = why
        return

    removable = _idle_candidates(serving=serving, in_use=in_use, waiting=waiting, depth=depth)
    idle_for = float(settings.REPLICA_IDLE_SECONDS)
    busy = [
        f"idle:{d.id}" for d in serving if str(d.id) not in removable and f"idle:{d.id}" in state
    ]
    if busy:
        r.hdel(key, *busy)
    # Youngest first, and never the last serving replica.
    for dep_id in sorted(removable, key=lambda i: removable[i], reverse=True):
        field_name = f"idle:{dep_id}"
        idle_since = state.get(field_name)
        if idle_since is None:
            r.hset(key, field_name, repr(t))
            continue
        if t - float(idle_since) >= idle_for and len(serving) > 1:
            _replica_remove(
                deployment=next(d for d in serving if str(d.id) == dep_id),
                now=now,
                idle_seconds=t - float(idle_since),
            )
            r.hdel(key, field_name)
            report.removed.append(dep_id)
            return


def _scale_up_blocked(*, deps: list[Deployment]) -> str | None:
    """Why no replica may be added now, or None."""
    if any(d.state in DEPLOYMENT_PENDING for d in deps):
        return "a replica is still being placed or loaded"
    limit = int(settings.REPLICA_MAX_PER_MODEL)
    if len(deps) >= limit:
        return f"already {len(deps)} replicas (REPLICA_MAX_PER_MODEL {limit})"
    return None


def _replica_request(*, model: Model, serving: list[Deployment]) -> PlacementRequest:
    """The newest serving replica's request (same context and slots rule), on no node that
    serves the model: pins, spread and same-node permission do not carry over to a copy."""
    template = serving[-1] if serving else None
    base = (
        placement_request_from(dict(template.request))
        if template is not None
        else placement_request_from({})
    )
    serving_nodes = selectors.nodes_serving_model(model_id=ids.model_id(model.id))
    exclude = tuple(dict.fromkeys([*base.exclude_nodes, *sorted(serving_nodes)]))
    return dataclasses.replace(
        base, pin_nodes=None, spread=False, allow_same_node=False, exclude_nodes=exclude
    )


def _replica_add(
    *, model: Model, serving: list[Deployment], now: datetime, wait: float, depth: int
) -> tuple[Deployment | None, str]:
    """Place one more replica when a node can host it: (the deployment, "") or (None, why not)."""
    request = _replica_request(model=model, serving=serving)
    # The file the copy's engine serves (the template's engine: a vLLM replica's directory).
    model_file = engine_model_file(model, request.engine)
    if model_file is None:
        return None, "the model has no registered file"
    try:
        plan = deployment_preview(model_file=model_file, request=request)
    except PlacementRefused as exc:
        return None, f"no node can host another copy: {exc.reason}"
    replicas = len(serving) + 1
    with transaction.atomic():
        dep = deployment_create(model=model, request=request, now=now, auto=True)
        event_record(
            kind="REPLICA_ADDED",
            category=EventCategory.PLACEMENT,
            now=now,
            deployment_id=ids.deployment_id(dep.id),
            node_id=NodeId(plan.primary_node_id),
            message=f"replica {replicas} of {model.name}: queue wait {wait:.1f}s with {depth} waiting",
            data={
                "queue_wait_seconds": round(wait, 3),
                "queue_depth": depth,
                "replicas": replicas,
                "excluded": list(request.exclude_nodes),
            },
        )
    log.info("added replica %s of %s (wait %.1fs, %d waiting)", dep.id, model.name, wait, depth)
    return dep, ""


def _idle_candidates(
    *, serving: list[Deployment], in_use: dict[str, int], waiting: dict[str, int], depth: int
) -> dict[str, datetime]:
    """Serving replicas this autoscaler added that are idle now → their creation time."""
    if depth > 0 or len(serving) <= 1:
        return {}
    ids = [d.id for d in serving]
    added = {
        str(i)
        for i in Event.objects.filter(kind="REPLICA_ADDED", deployment_id__in=ids).values_list(
            "deployment_id", flat=True
        )
    }
    return {
        str(d.id): d.created_at
        for d in serving
        if str(d.id) in added and in_use.get(str(d.id), 0) == 0 and waiting.get(str(d.id), 0) == 0
    }


def _replica_remove(*, deployment: Deployment, now: datetime, idle_seconds: float) -> None:
    """Stop an idle replica and record REPLICA_REMOVED."""
    with transaction.atomic():
        deployment_stop(
            deployment_id=ids.deployment_id(deployment.id),
            now=now,
            reason=f"idle replica removed after {idle_seconds:.0f}s",
        )
        event_record(
            kind="REPLICA_REMOVED",
            category=EventCategory.PLACEMENT,
            now=now,
            deployment_id=ids.deployment_id(deployment.id),
            node_id=ids.node_id(deployment.primary_id) if deployment.primary_id else None,
            message=f"idle for {idle_seconds:.0f}s (no slot in use, no queue)",
            data={"idle_seconds": round(idle_seconds, 1)},
        )
    log.info("removed idle replica %s", deployment.id)
