"""Writes for commands to agents, deployments (create, health, stop) and jobs (dispatch, finish,
cancel). A deployment's placement and loading are in placement.py, a node's drain in drain.py,
a job's failover in failover.py: those import from here, never the other way round.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone
from redis.exceptions import LockError

from agent.protocol import job_cancel_key, job_stream_key, new_id, node_queue_key
from apps.models_repo.models import Model, ModelFile
from apps.models_repo.profile import ModelProfile
from apps.nodes.errors import ReportRefused
from apps.nodes.events import event_record
from apps.nodes.links import link_measurements, link_prune
from apps.nodes.models import Event, EventCategory, Node
from apps.nodes.services import node_drain_advance
from apps.nodes.states import DRAIN_STATES, HEALTHY, LOST, ONLINE, NodeState
from racon import cache
from racon.broadcast import broadcast
from racon.celery import task_send_on_commit
from racon.redis import get_redis, get_redis_blocking
from racon.transitions import transition_guarded

from . import admission, hooks, kvcache, selectors, streams
from .models import Deployment, Job, JobAttempt
from .scheduler import CostModel, PlacementRequest, Plan, plan_placement
from .states import (
    DEPLOYMENT_ACTIVE,
    DEPLOYMENT_PENDING,
    DEPLOYMENT_SERVING,
    DEPLOYMENT_TRANSITIONS,
    JOB_IN_FLIGHT,
    JOB_OPEN,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    DeploymentState,
    JobState,
)

log = logging.getLogger("racon.jobs")
D = DeploymentState
J = JobState


class DeploymentError(Exception):
    """A deployment step failed; the message is meant for the operator."""


# --- commands to agents ------------------------------------------------------------------------


def _result_key(command_id: str) -> str:
    return f"racon:cmdresult:{command_id}"


def _command_node_key(command_id: str) -> str:
    return f"racon:cmd:{command_id}:node"


# Longer than the longest command_wait (a model transfer, MODEL_FETCH_TIMEOUT 1800 s), so a slow
# but honest result still finds whom its command was sent to.
COMMAND_NODE_TTL_SECONDS = 2 * 3600


def command_send(*, node_id: Any, kind: str, payload: dict[str, Any]) -> str:
    """Append a command to the node's own queue and remember which node it went to.

    The two writes are one MULTI: a result can never arrive for a command whose node is unknown.
    """
    command_id = new_id()
    body = {"id": command_id, "kind": kind, "payload": payload, "issued_at": time.time()}
    with get_redis().pipeline(transaction=True) as pipe:
        pipe.set(_command_node_key(command_id), str(node_id), ex=COMMAND_NODE_TTL_SECONDS)
        pipe.rpush(node_queue_key(str(node_id)), json.dumps(body, separators=(",", ":")))
        pipe.execute()
    return command_id


def command_wait(*, command_id: str, timeout: float) -> dict[str, Any] | None:
    """Block until the agent's command_result for this command arrives, or None on timeout."""
    got = get_redis_blocking().blpop([_result_key(command_id)], timeout=max(1, int(timeout)))
    if got is None:
        return None
    return json.loads(got[1])


def command_result_accept(
    *, node_id: Any, command_id: str | None, payload: dict[str, Any], now: datetime
) -> None:
    """Hand a command's result to whoever waits for it (placement), kept briefly for late readers."""
    if not command_id:
        raise ValueError("command_result needs command_id")
    r = get_redis()
    sent_to = r.get(_command_node_key(command_id))
    if sent_to is None:
        raise ReportRefused(
            f"command_result refused: command {command_id} was never sent, "
            f"or its result is over {COMMAND_NODE_TTL_SECONDS}s late",
            code="unknown_command",
        )
    if sent_to != str(node_id):
        raise ReportRefused(
            f"command_result refused: command {command_id} was sent to another node, not to node {node_id}",
            code="not_command_node",
        )
    key = _result_key(command_id)
    with r.pipeline(transaction=False) as pipe:
        pipe.rpush(key, json.dumps({**payload, "node_id": str(node_id)}, default=str))
        pipe.expire(key, 600)
        pipe.execute()
    if not payload.get("ok", False):
        event_record(
            kind="COMMAND_FAILED",
            category=EventCategory.RUNTIME,
            now=now,
            node_id=node_id,
            deployment_id=(payload.get("deployment_id") or None),
            message=str(payload.get("error", "command failed"))[:500],
            data={"command_id": command_id, "command": payload.get("kind", "")},
        )


# --- deployments -----------------------------------------------------------------------------


def deployment_transition(
    *,
    deployment_id: Any,
    to: str,
    now: datetime,
    expected: str | Collection[str] | None = None,
    kind: str = "DEPLOYMENT_STATE_CHANGED",
    message: str = "",
    data: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
) -> bool:
    """Guarded move of a deployment's state with its event (racon.transitions); a stale caller changes nothing."""
    extra = dict(fields or {})
    if to == D.READY:
        extra.setdefault("ready_at", now)
    if to == D.STOPPED:
        extra.setdefault("stopped_at", now)

    def record(src: str) -> None:
        if (
            src != to or kind != "DEPLOYMENT_STATE_CHANGED"
        ):  # PLANNING → PLANNING is a re-plan, not news
            event_record(
                kind=kind,
                category=EventCategory.PLACEMENT,
                now=now,
                deployment_id=deployment_id,
                old_state=src,
                new_state=to,
                message=message or f"deployment {src} → {to}",
                data=data,
            )

    def after_commit(src: str) -> None:
        broadcast(
            "nodes.dashboard",
            {"type": "deployment.changed", "deployment_id": str(deployment_id), "state": to},
        )

    moved = transition_guarded(
        model=Deployment,
        pk=deployment_id,
        to=to,
        table=DEPLOYMENT_TRANSITIONS,
        expected=expected,
        fields=extra,
        record=record,
        after_commit=after_commit,
    )
    if moved is None:
        return False
    if to in (D.FAILED, D.STOPPED):
        # Routing skips it at once in every process, before the cache invalidation is heard.
        admission.deployment_mark_dead(
            deployment_id=deployment_id, seconds=max(60.0, 3 * float(settings.API_CACHE_SECONDS))
        )
    # The route candidates (READY deployments of a model) every daphne process caches.
    cache.invalidate(selectors.ROUTE_CACHE)
    return True


def placement_request_from(data: dict[str, Any]) -> PlacementRequest:
    """Build a PlacementRequest from API input (n_ctx, n_parallel, nodes, exclude, spread, allow_same_node).

    No n_parallel: the scheduler chooses the slots from memory, up to DEFAULT_N_PARALLEL_MAX. A
    given one is passed on as is, so 0 or less is refused by the scheduler, never made 1.
    """
    pins = data.get("nodes") or data.get("pin_nodes") or None
    n_parallel = data.get("n_parallel")
    return PlacementRequest(
        n_ctx=int(data.get("n_ctx") or settings.DEFAULT_N_CTX),
        n_parallel=None if n_parallel is None else int(n_parallel),
        max_parallel=int(settings.DEFAULT_N_PARALLEL_MAX),
        prompt_tokens=int(data.get("prompt_tokens") or 128),
        pin_nodes=tuple(str(p) for p in pins) if pins else None,
        exclude_nodes=tuple(str(x) for x in data.get("exclude_nodes") or ()),
        spread=bool(data.get("spread", False)),
        allow_same_node=bool(data.get("allow_same_node", False)),
    )


def deployment_preview(
    *, model_file: ModelFile, request: PlacementRequest, exclude_deployment: Any = None
) -> Plan:
    """The plan and predictions for this model now, without loading anything."""
    profile = ModelProfile.from_dict(model_file.profile)
    snapshot = selectors.cluster_snapshot(
        model_file=model_file, exclude_deployment=exclude_deployment
    )
    t0 = time.perf_counter()
    try:
        return plan_placement(profile, snapshot, request, cost=scheduler_cost_model())
    finally:
        _record_placement_latency(time.perf_counter() - t0)


def _record_placement_latency(seconds: float) -> None:
    r = get_redis()
    with r.pipeline(transaction=False) as pipe:
        pipe.incr("racon:metrics:placements")
        pipe.incrbyfloat("racon:metrics:placement_seconds", seconds)
        pipe.execute()


def scheduler_cost_model() -> CostModel:
    """The cost model's constants, calibrated by bench/scheduler.py part 3 (settings)."""
    return CostModel(rpc_overhead_ms=float(settings.SCHEDULER_RPC_OVERHEAD_MS))


def deployment_create(
    *, model: Model, request: PlacementRequest, now: datetime, auto: bool = False
) -> Deployment:
    """Record a deployment (PLANNING) and ask Celery to place it once this transaction commits."""
    model_file = model.files.order_by("-created_at").first()
    if model_file is None:
        raise DeploymentError(f"model {model.name!r} has no registered file")
    with transaction.atomic():
        # n_parallel left to memory is known once planned (deployment_place records the plan's).
        dep = Deployment.objects.create(
            model=model,
            model_file=model_file,
            state=D.PLANNING,
            request=request.to_dict(),
            n_ctx=request.n_ctx,
            n_parallel=request.n_parallel or 1,
        )
        event_record(
            kind="DEPLOYMENT_CREATED",
            category=EventCategory.PLACEMENT,
            now=now,
            deployment_id=dep.id,
            new_state=D.PLANNING,
            message=f"{'automatic ' if auto else ''}deployment of {model.name}",
            data={"request": request.to_dict(), "auto": auto},
        )
        task_send_on_commit("racon.jobs.place_deployment", deployment_id=str(dep.id))
    return dep


def deployment_stop(
    *, deployment_id: Any, now: datetime, reason: str = "stopped by operator"
) -> Deployment:
    """Stop a deployment: unload its primary; running jobs are cancelled."""
    dep = Deployment.objects.get(pk=deployment_id)
    if dep.state == D.STOPPED:
        return dep
    if dep.state == D.FAILED or deployment_transition(
        deployment_id=dep.id, to=D.STOPPED, now=now, kind="DEPLOYMENT_STOPPED", message=reason
    ):
        if dep.state == D.FAILED:
            deployment_transition(
                deployment_id=dep.id,
                to=D.STOPPED,
                now=now,
                kind="DEPLOYMENT_STOPPED",
                message=reason,
            )
        if dep.primary_id:
            command_send(
                node_id=dep.primary_id, kind="unload", payload={"deployment_id": str(dep.id)}
            )
        # Its slots' KV state goes with the process: whatever was not moved is dropped, said so.
        kvcache.deployment_drop(deployment_id=dep.id, reason=f"the replica stopped ({reason})")
        for job_id in Job.objects.filter(deployment=dep, state__in=JOB_OPEN).values_list(
            "id", flat=True
        ):
            job_cancel(job_id=job_id, now=now, reason="deployment stopped")
    dep.refresh_from_db()
    return dep


def deployments_on_node_state(*, node_id: str, state: str, now: datetime) -> None:
    """A member node changed health: degrade, fail and replace, or restore its deployments."""
    deps = list(
        Deployment.objects.filter(
            nodes__id=node_id, state__in=list(DEPLOYMENT_ACTIVE)
        ).select_related("model")
    )
    for dep in deps:
        if state == NodeState.DEGRADED and dep.state == D.READY:
            deployment_transition(
                deployment_id=dep.id,
                to=D.DEGRADED,
                expected=D.READY,
                now=now,
                kind="DEPLOYMENT_DEGRADED",
                message=f"member {selectors.node_name(node_id)} degraded",
            )
        elif state == NodeState.READY and dep.state == D.DEGRADED:
            members_ok = (
                not Node.objects.filter(pk__in=dep.nodes.values("id"))
                .exclude(state__in=HEALTHY)
                .exists()
            )
            if members_ok:
                deployment_transition(
                    deployment_id=dep.id,
                    to=D.READY,
                    expected=D.DEGRADED,
                    now=now,
                    kind="DEPLOYMENT_RESTORED",
                    message="all members healthy again",
                )
        elif state in LOST and dep.state in DEPLOYMENT_SERVING:
            if deployment_transition(
                deployment_id=dep.id,
                to=D.FAILED,
                now=now,
                kind="DEPLOYMENT_FAILED",
                message=f"member {selectors.node_name(node_id)} is {state}",
                fields={"error": f"member node {node_id} {state}"},
            ):
                _jobs_fail_unread(
                    dep=dep, now=now, error=f"a node of the plan went {state} during execution"
                )
                if dep.primary_id and str(dep.primary_id) != node_id:
                    command_send(
                        node_id=dep.primary_id,
                        kind="unload",
                        payload={"deployment_id": str(dep.id)},
                    )
                # Replace it: a new placement without the lost node.
                deployment_replace(dep=dep, node_id=node_id, now=now, exclude=(node_id,))
        elif state in LOST and dep.state in DEPLOYMENT_PENDING:
            pass  # the placement task sees the lost node and re-scores (PLAN_REVISED)


def _jobs_fail_unread(*, dep: Deployment, now: datetime, error: str) -> None:
    """Fail the failed deployment's open jobs that nobody reads. A job whose reader is live (it
    holds the slot lease, or is failing the job over) is the reader's: it moves the job to
    another replica (docs/design/serving.md, "Failover"), or fails it if no capacity appears."""
    for job_id in Job.objects.filter(deployment=dep, state__in=JOB_OPEN).values_list(
        "id", flat=True
    ):
        if admission.job_reader_live(deployment_id=dep.id, job_id=job_id):
            log.info("job %s: deployment %s failed; its reader fails it over", job_id, dep.id)
            continue
        job_fail(job_id=job_id, now=now, error=error, during_execution=True)


def deployment_failed_replace(
    *, dep: Deployment, node_id: Any, message: str, now: datetime
) -> bool:
    """A serving deployment whose primary died: FAILED (routing skips it), its unread jobs failed,
    and replaced, once. False when it had already left serving (another report got there first)."""
    fresh = Deployment.objects.select_related("model").filter(pk=dep.pk).first()
    if fresh is None or fresh.state not in DEPLOYMENT_SERVING:
        return False  # already failed (a RUNTIME_FAILED report, a lost node), or never served
    if not deployment_transition(
        deployment_id=fresh.id,
        to=D.FAILED,
        expected=fresh.state,
        now=now,
        kind="DEPLOYMENT_FAILED",
        message=message[:500],
        fields={"error": message[:2000]},
    ):
        return False
    _jobs_fail_unread(dep=fresh, now=now, error=f"runtime failure during execution: {message}")
    deployment_replace(dep=fresh, node_id=node_id, now=now)
    return True


def deployment_replace(
    *, dep: Deployment, node_id: Any, now: datetime, exclude: tuple[Any, ...] = ()
) -> Deployment:
    """A new automatic placement with ``dep``'s request (less the ``exclude`` nodes), recorded as
    DEPLOYMENT_REPLACED on the old deployment and the node that caused it."""
    request = deployment_request_of(dep)
    if exclude:
        request["exclude_nodes"] = exclude
    replacement = deployment_create(
        model=dep.model, request=PlacementRequest(**request), now=now, auto=True
    )
    event_record(
        kind="DEPLOYMENT_REPLACED",
        category=EventCategory.PLACEMENT,
        now=now,
        deployment_id=dep.id,
        node_id=node_id,
        message=f"replaced by {replacement.id}",
        data={"replacement": str(replacement.id)},
    )
    return replacement


def _uuid_or_refuse(value: Any, *, what: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ValueError(f"{what} {str(value)[:80]!r} is not a UUID") from None


def deployment_member_check(*, deployment_id: Any, node_id: Any) -> Deployment:
    """The deployment, if the node is its primary or one of its plan's nodes; ReportRefused if not."""
    dep_id = _uuid_or_refuse(deployment_id, what="deployment_id")
    dep = Deployment.objects.select_related("model").filter(pk=dep_id).first()
    if dep is None:
        raise ValueError(f"unknown deployment {dep_id}")
    if str(dep.primary_id) != str(node_id) and not dep.nodes.filter(pk=node_id).exists():
        raise ReportRefused(
            f"node {node_id} is not a member of deployment {dep_id}'s plan", code="not_plan_member"
        )
    return dep


def job_primary_check(*, job_id: Any, node_id: Any) -> uuid.UUID:
    """The job's id, if the node is the primary of its plan (the one that runs it); ReportRefused if not."""
    job_uuid = _uuid_or_refuse(job_id, what="job_id")
    job = Job.objects.filter(pk=job_uuid).values("placement", "deployment__primary_id").first()
    if job is None:
        raise ValueError(f"unknown job {job_uuid}")
    primaries = {
        str(p)
        for p in (job["deployment__primary_id"], (job["placement"] or {}).get("primary"))
        if p
    }
    # After a failover, each attempt's primary may still report on its own attempt (stale: ignored).
    primaries |= {
        str(p)
        for p in JobAttempt.objects.filter(job_id=job_uuid).values_list("primary_id", flat=True)
        if p
    }
    if str(node_id) not in primaries:
        raise ReportRefused(
            f"node {node_id} is not the primary of job {job_uuid}'s plan", code="not_plan_member"
        )
    return job_uuid


def deployment_runtime_failed(
    *, deployment_id: Any, node_id: Any, message: str, now: datetime
) -> bool:
    """The primary process died (an RPC peer crashed, or it aborted): FAILED, jobs failed, replaced.

    Only a member of the deployment's plan may say so (ReportRefused otherwise; nothing changes).
    """
    dep = deployment_member_check(deployment_id=deployment_id, node_id=node_id)
    if dep.state not in DEPLOYMENT_SERVING:
        return False  # while LOADING, the placement task owns failures (and re-plans)
    return deployment_failed_replace(dep=dep, node_id=node_id, message=message, now=now)


def deployments_lost_on_restart(*, node_id: Any, loaded: list[str], now: datetime) -> list[str]:
    """A node's agent (re)started holding only the deployments in ``loaded``: every serving
    deployment the node is a member of and no longer holds is FAILED and replaced at once.

    An agent's primaries and RPC worker are its children and die with it, and a restarted
    agent does not reload them: without this the controller would keep routing to a READY
    deployment the node answers with ``deployment_not_loaded``. The agent says so before any
    other report (its first, AGENT_STARTED), so a deployment placed after the restart is never
    taken for a lost one. Returns the ids failed.
    """
    keep = {str(d) for d in loaded}
    deps = (
        Deployment.objects.filter(state__in=DEPLOYMENT_SERVING)
        .filter(Q(primary_id=node_id) | Q(nodes__id=node_id))
        .distinct()
    )
    failed: list[str] = []
    for dep in deps:
        if str(dep.pk) in keep:
            continue
        role = "primary" if str(dep.primary_id) == str(node_id) else "RPC worker"
        deployment_failed_replace(
            dep=dep,
            node_id=node_id,
            message=f"the agent of its {role} node restarted and no longer holds it",
            now=now,
        )
        failed.append(str(dep.pk))
    return failed


def links_probe_request(
    *, node_id: Any, max_peers: int = 32, measured_at: dict[str, float] | None = None
) -> str | None:
    """Ask a node to measure its links to at most ``max_peers`` other live nodes, those it has
    never measured first, then the stalest (``measured_at``: peer → when, from this node)."""
    if measured_at is None:
        measured_at = {
            m.target: m.measured_at
            for m in link_measurements(now=timezone.now(), include_expired=True)
            if m.source == str(node_id)
        }
    candidates = list(
        Node.objects.filter(state__in=ONLINE, revoked_at__isnull=True)
        .exclude(pk=node_id)
        .only("id", "address", "rpc_port")
    )
    candidates.sort(key=lambda n: (measured_at.get(str(n.id), 0.0), str(n.id)))
    peers = [
        {"node_id": str(n.id), "address": n.address, "rpc_port": n.rpc_port}
        for n in candidates[:max_peers]
    ]
    if not peers:
        return None
    return command_send(node_id=node_id, kind="probe_links", payload={"peers": peers})


def links_reprobe(*, now: datetime) -> dict[str, int]:
    """One periodic round: drop expired links (and those of revoked or deleted nodes), then ask
    every READY node to re-measure at most LINK_PROBE_MAX_PEERS peers, the stalest first."""
    live = {
        str(n) for n in Node.objects.filter(revoked_at__isnull=True).values_list("id", flat=True)
    }
    pruned = link_prune(now=now, node_ids=live)
    by_source: dict[str, dict[str, float]] = {}
    for m in link_measurements(now=now, include_expired=True):
        by_source.setdefault(m.source, {})[m.target] = m.measured_at
    sent = 0
    for nid in Node.objects.filter(state=NodeState.READY, revoked_at__isnull=True).values_list(
        "id", flat=True
    ):
        if links_probe_request(
            node_id=nid,
            max_peers=int(settings.LINK_PROBE_MAX_PEERS),
            measured_at=by_source.get(str(nid), {}),
        ):
            sent += 1
    return {"pruned": pruned, "requested": sent}


def deployment_request_of(dep: Deployment) -> dict[str, Any]:
    req = dict(dep.request)
    req["pin_nodes"] = tuple(req["pin_nodes"]) if req.get("pin_nodes") else None
    req["exclude_nodes"] = tuple(req.get("exclude_nodes") or ())
    return req


def ensure_lock_key(model_id: Any) -> str:
    return f"racon:lock:ensure:{model_id}"


@contextmanager
def redis_lock(name: str, *, timeout: float) -> Iterator[bool]:
    """Hold a Redis lock (expiring after timeout, so a dead holder frees it); yields whether it
    was acquired: after waiting timeout for it, the caller goes on unlocked rather than fail."""
    lock = get_redis().lock(name, timeout=timeout, blocking_timeout=timeout)
    acquired = bool(lock.acquire())
    if not acquired:
        log.warning("lock %s not acquired within %.0fs; going on without it", name, timeout)
    try:
        yield acquired
    finally:
        if acquired:
            try:
                lock.release()
            except LockError:
                pass  # expired meanwhile: someone else may hold it now, and that is theirs


def deployment_ensure(*, model: Model, now: datetime) -> Deployment:
    """An active deployment of the model, creating one automatically when there is none.

    Concurrent first requests (several daphne processes) create one deployment between them: the
    look and the create run under a per-model lock, and the create commits before it is released.
    A deployment with a draining member takes no new job: its replacement (being placed on other
    nodes, or FAILED when no capacity exists, so the request fails with the reason) is returned.
    """

    def active() -> Deployment | None:
        qs = Deployment.objects.filter(model=model, state__in=list(DEPLOYMENT_ACTIVE))
        return selectors.deployments_off_drained_nodes(qs).order_by("-created_at").first()

    existing = active()
    if existing is not None:
        return existing
    with redis_lock(ensure_lock_key(model.id), timeout=30):
        existing = active()
        if existing is not None:
            return existing
        draining = (
            selectors.deployments_on_drained_nodes(
                Deployment.objects.filter(model=model, state__in=list(DEPLOYMENT_SERVING))
            )
            .select_related("model")
            .first()
        )
        if draining is not None:
            replacement = drain_replacement_locked(
                dep=draining, node_id=_draining_member(draining), now=now
            )
            if replacement is not None:
                return replacement
        return deployment_create(
            model=model, request=placement_request_from({}), now=now, auto=True
        )


# --- drain helpers (the drain itself is apps/jobs/drain.py) -----------------------------------
#
# Here rather than in drain.py because deployment_ensure (a first request meeting a draining
# deployment), deployment placement and a job's end use them too.


def _draining_member(dep: Deployment) -> str:
    node_id = (
        Node.objects.filter(Q(deployments=dep) | Q(primary_of=dep), state__in=DRAIN_STATES)
        .values_list("id", flat=True)
        .first()
    )
    return str(node_id or dep.primary_id)


def drain_replacement_recorded(dep: Deployment) -> tuple[bool, Deployment | None]:
    event = (
        Event.objects.filter(kind="DEPLOYMENT_MIGRATING", deployment_id=dep.id)
        .order_by("-created_at", "-id")
        .first()
    )
    if event is None:
        return False, None
    replacement_id = (event.data or {}).get("replacement")
    return True, (
        Deployment.objects.filter(pk=str(replacement_id)).first() if replacement_id else None
    )


def drain_replacement_locked(*, dep: Deployment, node_id: Any, now: datetime) -> Deployment | None:
    found, replacement = drain_replacement_recorded(dep)
    if found:
        return replacement
    request = deployment_request_of(dep)
    request["exclude_nodes"] = tuple(dict.fromkeys([*request["exclude_nodes"], str(node_id)]))
    try:
        # One transaction: the event that names the replacement commits with it, before its
        # placement is sent (under eager Celery the placement runs at the commit, and its READY
        # advances this drain again, which must find the replacement already recorded).
        with transaction.atomic():
            replacement = deployment_create(
                model=dep.model, request=PlacementRequest(**request), now=now, auto=True
            )
            event_record(
                kind="DEPLOYMENT_MIGRATING",
                category=EventCategory.PLACEMENT,
                now=now,
                deployment_id=dep.id,
                node_id=node_id,
                message=(
                    f"node {selectors.node_name(node_id)} drains: "
                    f"replacement {replacement.id} is placed on other nodes"
                ),
                data={"replacement": str(replacement.id)},
            )
    except DeploymentError as exc:
        log.warning(
            "no replacement for deployment %s off draining node %s: %s", dep.id, node_id, exc
        )
        return None
    replacement.refresh_from_db()
    return replacement


def drains_advance(*, deployments: QuerySet[Deployment], now: datetime) -> None:
    """Advance the drain of every draining node that is a member of these deployments."""
    node_ids = set(
        Node.objects.filter(
            Q(deployments__in=deployments) | Q(primary_of__in=deployments), state=NodeState.DRAINING
        ).values_list("id", flat=True)
    )
    for node_id in node_ids:
        node_drain_advance(node_id=node_id, now=now)


# --- jobs ---------------------------------------------------------------------------------------


def job_transition(
    *,
    job_id: Any,
    to: str,
    now: datetime,
    expected: str | Collection[str] | None = None,
    fields: dict[str, Any] | None = None,
    kind: str | None = None,
    message: str = "",
    data: dict[str, Any] | None = None,
) -> bool:
    """Guarded move of a job's state (racon.transitions); writes its event when ``kind`` names one.

    Terminal states are final.
    """

    def record(src: str) -> None:
        event_record(
            kind=kind or "",
            category=EventCategory.EXECUTION,
            now=now,
            job_id=job_id,
            deployment_id=(fields or {}).get("deployment_id"),
            old_state=src,
            new_state=to,
            message=message,
            data=data,
        )

    moved = transition_guarded(
        model=Job,
        pk=job_id,
        to=to,
        table=JOB_TRANSITIONS,
        expected=expected,
        fields=fields,
        record=record if kind else None,
    )
    return moved is not None


def job_create(
    *,
    model: Model,
    account_id: Any,
    api_key_id: Any,
    kind: str,
    params: dict[str, Any],
    max_tokens: int,
    stream: bool,
    request_id: str,
    now: datetime,
    job_id: Any = None,
    dispatched_to: Deployment | None = None,
    hold: Callable[[Job], None] | None = None,
) -> Job:
    """Record a QUEUED job and its credit hold (what ``hold`` raises propagates; nothing stays).

    ``hold`` is the api layer's credit reservation (jobs never imports credits): it runs in the
    transaction that creates the job, with the new row. With dispatched_to, the job's run_job was
    already pushed to that deployment's primary (the fast path): the same transaction records the
    dispatch, so the row, the hold and JOB_DISPATCHED are written while the primary evaluates the
    prompt.
    """
    with transaction.atomic():
        job = Job.objects.create(
            id=job_id or uuid.uuid4(),
            model=model,
            account_id=account_id,
            api_key_id=api_key_id,
            kind=kind,
            params=params,
            max_tokens=max_tokens,
            stream=stream,
            request_id=request_id,
            queued_at=now,
            state=J.QUEUED,
        )
        if hold is not None:
            hold(job)
        if dispatched_to is not None and not _record_dispatch(
            job=job, deployment=dispatched_to, now=now
        ):
            raise DeploymentError("job is no longer queued")
    return job


def job_run_payload(
    *, job_id: Any, deployment_id: Any, kind: str, max_tokens: int, params: dict[str, Any]
) -> dict[str, Any]:
    """The run_job command's payload (protocol.RunJobPayload)."""
    return {
        "job_id": str(job_id),
        "deployment_id": str(deployment_id),
        "kind": kind,
        "max_tokens": max_tokens,
        **params,
    }


def _record_dispatch(*, job: Job, deployment: Deployment, now: datetime) -> bool:
    """QUEUED → DISPATCHED with the plan's nodes and layers (the JOB_DISPATCHED event)."""
    plan = deployment.plan or {}
    placement = dispatch_placement(deployment)
    node_ids = dispatch_node_ids(deployment)
    with transaction.atomic():
        moved = job_transition(
            job_id=job.id,
            to=J.DISPATCHED,
            expected=J.QUEUED,
            now=now,
            fields={
                "deployment_id": deployment.id,
                "dispatched_at": now,
                "placement": {"devices": placement, "primary": plan.get("primary_node_id")},
            },
            kind="JOB_DISPATCHED",
            message=f"to deployment {deployment.id}",
            data={"nodes": node_ids},
        )
        if moved:
            job.nodes.set(node_ids)  # type: ignore[arg-type]  # pks; the stubs take only int pks
    return moved


def job_dispatch(
    *, job_id: Any, deployment: Deployment, now: datetime, id_slot: int | None = None
) -> dict[str, Any]:
    """QUEUED → DISPATCHED: push run_job onto the primary's queue, then record the plan's nodes.

    The push goes first: the primary starts on the prompt while the transition is written. If the
    job stopped being QUEUED meanwhile (cancelled), the primary is told to cancel it.
    The caller holds a slot for the job (admission); any failure here gives it back.
    ``id_slot``: the llama-server slot the KV cache coordinator pinned (apps/jobs/kvcache.py).
    """
    try:
        job = Job.objects.only("id", "kind", "max_tokens", "params").get(pk=job_id)
        payload = job_run_payload(
            job_id=job.id,
            deployment_id=deployment.id,
            kind=job.kind,
            max_tokens=job.max_tokens,
            params=job.params,
        )
        if id_slot is not None:
            payload["id_slot"] = id_slot
        command_send(node_id=deployment.primary_id, kind="run_job", payload=payload)
        if not _record_dispatch(job=job, deployment=deployment, now=now):
            get_redis().set(job_cancel_key(str(job.id), str(deployment.primary_id)), 1, ex=3600)
            raise DeploymentError("job is no longer queued")
    except BaseException:
        admission.slot_release(deployment_id=deployment.id, job_id=job_id)
        raise
    return {"nodes": dispatch_node_ids(deployment), "primary": str(deployment.primary_id)}


def dispatch_placement(deployment: Deployment) -> list[dict[str, Any]]:
    """The plan's devices as a job's dispatch records them: node, device and layer range."""
    return [
        {
            "node_id": d["node_id"],
            "node": selectors.node_name(d["node_id"]),
            "device": d["device"],
            "layers": [d["layer_start"], d["layer_end"]],
        }
        for d in (deployment.plan or {}).get("devices", [])
    ]


def dispatch_node_ids(deployment: Deployment) -> list[str]:
    return list(dict.fromkeys(d["node_id"] for d in (deployment.plan or {}).get("devices", [])))


def job_mark_running(*, job_id: Any, now: datetime) -> bool:
    """DISPATCHED → RUNNING at the first token."""
    return job_transition(
        job_id=job_id, to=J.RUNNING, expected=J.DISPATCHED, now=now, fields={"first_token_at": now}
    )


def _finish(
    *, job_id: Any, to: str, now: datetime, fields: dict[str, Any], kind: str, message: str
) -> bool:
    job = Job.objects.filter(pk=job_id).values("state", "deployment_id").first()
    if job is None or job["state"] in JOB_TERMINAL:
        return False
    with transaction.atomic():  # the job's end and its last attempt's, seen together
        moved = job_transition(
            job_id=job_id,
            to=to,
            now=now,
            fields={"finished_at": now, **fields},
            kind=kind,
            message=message,
        )
        if moved:
            _attempt_close(job_id=job_id, to=to, now=now, fields=fields)
    if moved:
        if job["deployment_id"]:
            admission.slot_release(deployment_id=job["deployment_id"], job_id=job_id)
        task_send_on_commit(
            "racon.credits.settle_job", job_id=str(job_id)
        )  # credits' task, by name
        _record_job_metrics(job_id=job_id, to=to, fields=fields)
        if job["deployment_id"]:
            # A draining node's last job may just have ended: its drain moves on (after commit,
            # so that the drain's own queries see this job finished).
            transaction.on_commit(
                functools.partial(
                    drains_advance,
                    deployments=Deployment.objects.filter(pk=job["deployment_id"]),
                    now=now,
                )
            )
    return moved


def _attempt_close(*, job_id: Any, to: str, now: datetime, fields: dict[str, Any]) -> None:
    """A failed-over job's end closes its last attempt, which produced what the others did not."""
    last = (
        JobAttempt.objects.filter(job_id=job_id, ended_at__isnull=True).order_by("-number").first()
    )
    if last is None:
        return  # never failed over: the job is its one attempt
    before = JobAttempt.objects.filter(job_id=job_id, number__lt=last.number).aggregate(
        tokens=Sum("completion_tokens"), chunks=Sum("chunks")
    )
    total = int(fields.get("completion_tokens") or 0)
    chunks = int(fields.get("stream_chunks") or 0)
    JobAttempt.objects.filter(pk=last.pk).update(
        ended_at=now,
        outcome=to,
        error=str(fields.get("error") or "")[:2000],
        completion_tokens=max(0, total - int(before["tokens"] or 0)),
        chunks=max(0, chunks - int(before["chunks"] or 0)),
    )


def _record_job_metrics(*, job_id: Any, to: str, fields: dict[str, Any]) -> None:
    hooks.job_finished.send(sender=Job, job_id=job_id, state=to, fields=fields)


def job_complete(
    *,
    job_id: Any,
    usage: dict[str, Any],
    finish_reason: str,
    chunks: int,
    now: datetime,
    device_seconds: dict[str, float] | None = None,
) -> bool:
    """→ COMPLETED with usage and timings; settlement follows."""
    fields = {
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "ttft_ms": usage.get("ttft_ms"),
        "tokens_per_s": usage.get("tokens_per_s"),
        "finish_reason": finish_reason or "stop",
        "stream_chunks": chunks,
    }
    if device_seconds:
        fields["device_seconds"] = device_seconds
    return _finish(
        job_id=job_id,
        to=J.COMPLETED,
        now=now,
        fields=fields,
        kind="JOB_COMPLETED",
        message=f"{fields['completion_tokens']} tokens, {fields['finish_reason']}",
    )


def job_fail(
    *,
    job_id: Any,
    now: datetime,
    error: str,
    during_execution: bool | None = None,
    usage: dict[str, Any] | None = None,
    chunks: int | None = None,
) -> bool:
    """→ FAILED with the error; only what was delivered is charged."""
    fields: dict[str, Any] = {
        "error": error[:2000],
        "failed_during_execution": during_execution,
        "finish_reason": "error",
    }
    if usage:
        fields["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        fields["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    if chunks is not None:
        fields["stream_chunks"] = chunks
    return _finish(
        job_id=job_id, to=J.FAILED, now=now, fields=fields, kind="JOB_FAILED", message=error[:300]
    )


def job_cancel(
    *,
    job_id: Any,
    now: datetime,
    reason: str = "cancelled",
    usage: dict[str, Any] | None = None,
    chunks: int | None = None,
) -> bool:
    """→ CANCELLED; sets the cancel flag the primary checks between tokens."""
    job = Job.objects.filter(pk=job_id).select_related("deployment").first()
    if (
        job is not None
        and job.deployment is not None
        and job.deployment.primary_id
        and job.state in JOB_IN_FLIGHT
    ):
        get_redis().set(job_cancel_key(str(job_id), str(job.deployment.primary_id)), 1, ex=3600)
        command_send(
            node_id=job.deployment.primary_id, kind="cancel_job", payload={"job_id": str(job_id)}
        )
    fields: dict[str, Any] = {"finish_reason": "cancelled", "error": reason[:2000]}
    if usage:
        fields["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        fields["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    if chunks is not None:
        fields["stream_chunks"] = chunks
    return _finish(
        job_id=job_id,
        to=J.CANCELLED,
        now=now,
        fields=fields,
        kind="JOB_CANCELLED",
        message=reason[:300],
    )


def job_finish_from_report(*, node_id: Any, payload: dict[str, Any], now: datetime) -> None:
    """The agent's job_finished report: the same guarded finish as the stream reader's.

    The counts billed are the controller's own, from the job's stream (a node's report is a
    claim); the report's figures are only the cross-check.
    """
    job_id = payload.get("job_id")
    if not job_id:
        raise ValueError("job_finished needs job_id")
    # Only the primary of the job's plan runs it: anyone else's report is refused, changing nothing.
    job_id = job_primary_check(job_id=job_id, node_id=node_id)
    status = payload.get("status")
    if status not in ("completed", "failed", "cancelled"):
        raise ValueError(f"unknown job status {status!r}")
    job = Job.objects.filter(pk=job_id).values("state", "kind", "params", "deployment_id").first()
    if job is None or job["state"] in JOB_TERMINAL:
        return  # the stream reader (or a sweep) finished it first, as it usually does
    attempt = _report_attempt(payload)
    current = (
        JobAttempt.objects.filter(job_id=job_id)
        .order_by("-number")
        .values("number", "primary_id", "ended_at")
        .first()
    )
    if current is not None and (
        attempt < current["number"]
        or str(current["primary_id"]) != str(node_id)
        or current["ended_at"] is not None
    ):
        # The same job id after a failover is the same job: the superseded attempt's end is news
        # about that attempt only, already recorded when the job moved on.
        log.info(
            "job %s: job_finished (%s) of superseded attempt %d from node %s ignored; attempt %d runs on node %s",
            job_id,
            status,
            attempt,
            node_id,
            current["number"],
            current["primary_id"],
        )
        return
    if status != "completed" and admission.job_reader_live(
        deployment_id=job["deployment_id"], job_id=job_id
    ):
        # A live reader saw the same end in the stream (or flagged the old primary to stop while
        # it fails the job over): it moves the job on, or records the end itself.
        log.info(
            "job %s: job_finished (%s) from node %s left to the job's live reader",
            job_id,
            status,
            node_id,
        )
        return
    claimed = {
        k: payload.get(k)
        for k in ("prompt_tokens", "completion_tokens", "ttft_ms", "tokens_per_s")
        if payload.get(k) is not None
    }
    chunks, tokens = streams.stream_tally(
        job_id, node_id, attempt=current["number"] if current is not None else None
    )
    if current is not None:
        before = JobAttempt.objects.filter(job_id=job_id, number__lt=current["number"]).aggregate(
            t=Sum("completion_tokens"), c=Sum("chunks")
        )
        tokens += int(before["t"] or 0)
        chunks += int(before["c"] or 0)
    usage = streams.billed_usage(
        completion_tokens=tokens,
        agent_usage=claimed,
        prompt_bound=streams.prompt_token_bound(kind=job["kind"], params=job["params"] or {}),
        job_id=job_id,
        check=status == "completed",
    )
    if status == "completed":
        job_complete(
            job_id=job_id,
            usage=usage,
            finish_reason=payload.get("finish_reason") or "stop",
            chunks=chunks,
            now=now,
            device_seconds=payload.get("device_seconds"),
        )
    elif status == "failed":
        job_fail(
            job_id=job_id,
            now=now,
            error=str(payload.get("error") or "failed on the node"),
            during_execution=True,
            usage=usage,
            chunks=chunks,
        )
    else:
        job_cancel(
            job_id=job_id,
            now=now,
            reason=str(payload.get("error") or "cancelled on the node"),
            usage=usage,
            chunks=chunks,
        )


def _report_attempt(payload: dict[str, Any]) -> int:
    try:
        return max(1, int(payload.get("attempt") or 1))
    except (TypeError, ValueError):
        return 1


def jobs_fail_stale(*, now: datetime) -> dict[str, int]:
    """Close jobs nobody will finish: never dispatched, or silent far past the stream idle limit.

    A job whose stream already ended (the reader died after the last entry) is finished from that
    entry, so credits are settled for what was delivered and no hold stays open.
    """
    idle = float(settings.STREAM_IDLE_TIMEOUT_SECONDS) * 2
    queued_limit = (
        float(settings.DEPLOYMENT_WAIT_SECONDS) + float(settings.JOB_QUEUE_WAIT_SECONDS) + 60
    )
    r = get_redis()
    counts = {"queued": 0, "silent": 0, "finished_from_stream": 0}
    cutoff_q = now.timestamp() - queued_limit
    for job in Job.objects.filter(state=J.QUEUED).only("id", "queued_at", "deployment_id"):
        if job.queued_at.timestamp() < cutoff_q:
            if job_fail(
                job_id=job.id,
                now=now,
                error="never dispatched: no capacity in time",
                during_execution=False,
            ):
                counts["queued"] += 1
    running = (
        Job.objects.filter(state__in=JOB_IN_FLIGHT)
        .select_related("deployment")
        .only("id", "dispatched_at", "queued_at", "kind", "params", "deployment__primary_id")
    )
    for job in running:
        if r.exists(admission.failover_key(job.id)):
            continue  # its reader is moving it to another replica
        node = (
            str(job.deployment.primary_id)
            if job.deployment is not None and job.deployment.primary_id
            else ""
        )
        last = r.xrevrange(job_stream_key(str(job.id), node), count=1) if node else []
        if last:
            entry_id, fields = last[0]
            if fields.get("type") in ("done", "error"):
                # Billed on the controller's own count of the stream, as the follower would have.
                chunks, tokens = streams.stream_tally(job.id, node)
                usage = streams.billed_usage(
                    completion_tokens=tokens,
                    agent_usage=streams.entry_usage(fields),
                    prompt_bound=streams.prompt_token_bound(kind=job.kind, params=job.params),
                    job_id=job.id,
                )
                if fields.get("type") == "done" and fields.get("finish_reason") != "cancelled":
                    done = job_complete(
                        job_id=job.id,
                        usage=usage,
                        finish_reason=fields.get("finish_reason") or "stop",
                        chunks=chunks,
                        now=now,
                    )
                elif fields.get("type") == "done":
                    done = job_cancel(
                        job_id=job.id, now=now, reason="cancelled", usage=usage, chunks=chunks
                    )
                else:
                    done = job_fail(
                        job_id=job.id,
                        now=now,
                        error=fields.get("text") or "failed",
                        during_execution=True,
                        usage=usage,
                        chunks=chunks,
                    )
                counts["finished_from_stream"] += int(done)
                continue
            last_ts = int(entry_id.split("-")[0]) / 1000.0
        else:
            last_ts = (job.dispatched_at or job.queued_at).timestamp()
        if now.timestamp() - last_ts > idle:
            if job_fail(
                job_id=job.id,
                now=now,
                error=f"no output for {idle:.0f}s; the primary is gone",
                during_execution=True,
            ):
                counts["silent"] += 1
    return counts
