"""Writes for deployments (placement, loading, health) and jobs (dispatch, finish, cancel)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone
from redis.exceptions import LockError

from agent.protocol import job_cancel_key, job_stream_key, new_id, node_queue_key
from apps.models_repo.models import Model, ModelFile, Replica
from apps.models_repo.profile import ModelProfile
from apps.models_repo.services import replicas_sync
from apps.nodes.errors import ReportRefused
from apps.nodes.events import event_record
from apps.nodes.links import link_measurements, link_prune
from apps.nodes.models import Event, EventCategory, Node
from apps.nodes.services import node_drain_advance
from apps.nodes.states import DRAIN_STATES, HEALTHY, LOADABLE, LOST, ONLINE, NodeState
from racon import cache
from racon.broadcast import broadcast
from racon.celery import task_send_on_commit
from racon.logging import log_context
from racon.redis import get_redis, get_redis_blocking
from racon.transitions import transition_guarded

from . import admission, hooks, kvcache, selectors, streams
from .models import Deployment, Job, JobAttempt
from .scheduler import CostModel, PlacementRefused, PlacementRequest, Plan, plan_placement
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


def deployment_place(
    *, deployment_id: Any, clock: Callable[[], datetime] = timezone.now, max_revisions: int = 3
) -> Deployment:
    """Plan, start the RPC workers, load the primary and confirm every member; READY or FAILED.

    A node lost before execution (a step fails on it) is excluded and the plan revised.
    """
    dep = Deployment.objects.select_related("model", "model_file").get(pk=deployment_id)
    if dep.state != D.PLANNING:
        return dep  # a retried task: another run already took it
    request = PlacementRequest(**_request_of(dep))
    excluded: list[str] = list(request.exclude_nodes)
    with log_context(deployment_id=dep.id):
        for revision in range(max_revisions + 1):
            pins = (
                (tuple(p for p in request.pin_nodes if p not in excluded) or None)
                if request.pin_nodes
                else None
            )
            req = dataclasses.replace(request, exclude_nodes=tuple(excluded), pin_nodes=pins)
            try:
                with _placement_lock():
                    plan = deployment_preview(
                        model_file=dep.model_file, request=req, exclude_deployment=dep.id
                    )
                    with transaction.atomic():
                        Deployment.objects.filter(pk=dep.id).update(
                            plan=plan.to_dict(),
                            primary_id=plan.primary_node_id,
                            revision=revision,
                            n_ctx=plan.n_ctx,
                            n_parallel=plan.n_parallel,
                        )
                        dep.nodes.set(list(plan.node_ids))  # type: ignore[arg-type]  # pks; the stubs take only int pks
                        event_record(
                            kind="PLAN_REVISED" if revision else "PLAN_CHOSEN",
                            category=EventCategory.PLACEMENT,
                            now=clock(),
                            deployment_id=dep.id,
                            node_id=plan.primary_node_id,
                            message=(
                                f"primary {selectors.node_name(plan.primary_node_id)}, "
                                f"{len(plan.layer_devices)} device(s), {plan.n_parallel} slot(s), "
                                f"predicted {plan.predicted_tokens_per_s:.1f} tok/s"
                            ),
                            data={
                                "plan": plan.to_dict(),
                                "revision": revision,
                                "excluded": excluded,
                            },
                        )
            except PlacementRefused as exc:
                deployment_transition(
                    deployment_id=dep.id,
                    to=D.FAILED,
                    now=clock(),
                    kind="PLACEMENT_REFUSED",
                    message=exc.reason[:500],
                    data=exc.to_dict(),
                    fields={"error": exc.reason},
                )
                return Deployment.objects.get(pk=dep.id)
            deployment_transition(
                deployment_id=dep.id, to=D.LOADING, expected=D.PLANNING, now=clock()
            )
            try:
                report = _deployment_load(dep=dep, plan=plan, clock=clock)
            except _NodeLost as lost:
                excluded.append(lost.node_id)
                event_record(
                    kind="NODE_LOST_BEFORE_EXECUTION",
                    category=EventCategory.PLACEMENT,
                    now=clock(),
                    deployment_id=dep.id,
                    node_id=lost.node_id,
                    message=lost.reason,
                )
                if not deployment_transition(
                    deployment_id=dep.id,
                    to=D.PLANNING,
                    expected=D.LOADING,
                    now=clock(),
                    message="re-scoring without the lost node",
                ):
                    return Deployment.objects.get(pk=dep.id)
                continue
            except DeploymentError as exc:
                deployment_transition(
                    deployment_id=dep.id,
                    to=D.FAILED,
                    expected=D.LOADING,
                    now=clock(),
                    kind="DEPLOYMENT_FAILED",
                    message=str(exc)[:500],
                    fields={"error": str(exc)},
                )
                return Deployment.objects.get(pk=dep.id)
            except SoftTimeLimitExceeded:
                # The placement worker's bound (settings.PLACEMENT_SOFT_TIME_LIMIT): fail visibly
                # rather than be killed at the hard limit with the deployment left LOADING.
                message = (
                    f"placement timed out after {settings.PLACEMENT_SOFT_TIME_LIMIT:.0f}s "
                    "(PLACEMENT_SOFT_TIME_LIMIT)"
                )
                deployment_transition(
                    deployment_id=dep.id,
                    to=D.FAILED,
                    expected=D.LOADING,
                    now=clock(),
                    kind="DEPLOYMENT_FAILED",
                    message=message,
                    fields={"error": message},
                )
                return Deployment.objects.get(pk=dep.id)
            except Exception as exc:
                # Never leave a deployment LOADING forever: an unexpected fault fails it, visibly.
                log.exception("placement of deployment %s failed", dep.id)
                deployment_transition(
                    deployment_id=dep.id,
                    to=D.FAILED,
                    expected=D.LOADING,
                    now=clock(),
                    kind="DEPLOYMENT_FAILED",
                    message=f"internal error during placement: {exc}"[:500],
                    fields={"error": str(exc)},
                )
                return Deployment.objects.get(pk=dep.id)
            if deployment_transition(
                deployment_id=dep.id,
                to=D.READY,
                expected=D.LOADING,
                now=clock(),
                kind="DEPLOYMENT_READY",
                message="every member confirmed ready",
                fields={"load_report": report},
            ):
                _drains_advance(
                    deployments=Deployment.objects.filter(
                        model_id=dep.model_id, state__in=list(DEPLOYMENT_SERVING)
                    ),
                    now=clock(),
                )
            return Deployment.objects.get(pk=dep.id)
        deployment_transition(
            deployment_id=dep.id,
            to=D.FAILED,
            now=clock(),
            kind="DEPLOYMENT_FAILED",
            message="too many plan revisions",
            fields={"error": "too many plan revisions"},
        )
        return Deployment.objects.get(pk=dep.id)


class _NodeLost(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(reason)
        self.node_id = node_id
        self.reason = reason


def _deployment_load(
    *, dep: Deployment, plan: Plan, clock: Callable[[], datetime]
) -> dict[str, Any]:
    """Setup and validation: RPC workers, model file on the primary, primary load, member check."""
    timeout_rpc = settings.DEPLOYMENT_RPC_TIMEOUT
    timeout_load = settings.DEPLOYMENT_LOAD_TIMEOUT
    # 1. start or confirm the RPC workers of the plan, and let only this plan's primary through
    # their tunnels: a fresh key per deployment (and placement attempt), never stored, sent only
    # in the commands of the plan's members.
    tunnel_key = secrets.token_hex(32)
    primary_address = (
        Node.objects.filter(pk=plan.primary_node_id).values_list("address", flat=True).first()
    )
    for worker in plan.rpc_workers():
        node_id = worker["node_id"]
        _require_live(node_id)
        grant = {
            "deployment_id": str(dep.id),
            "tunnel_key": tunnel_key,
            "primary_address": primary_address,
        }
        cid = command_send(node_id=node_id, kind="rpc_start", payload=grant)
        result = command_wait(command_id=cid, timeout=timeout_rpc)
        if result is None:
            raise _NodeLost(
                node_id,
                f"RPC worker on {selectors.node_name(node_id)} did not confirm within {timeout_rpc:.0f}s",
            )
        if not result.get("ok"):
            raise _NodeLost(
                node_id,
                f"RPC worker on {selectors.node_name(node_id)} failed: {result.get('error', '')}",
            )
        event_record(
            kind="RPC_WORKER_CONFIRMED",
            category=EventCategory.RUNTIME,
            now=clock(),
            node_id=node_id,
            deployment_id=dep.id,
            message=f"RPC worker ready at {worker['endpoint']}",
            data={
                "endpoint": worker["endpoint"],
                "result": {k: v for k, v in result.items() if k != "node_id"},
            },
        )
    # 2. the model file on the primary (only the primary needs it: workers get tensors over RPC)
    primary = plan.primary_node_id
    _require_live(primary)
    path = _ensure_model_file(dep=dep, node_id=primary, clock=clock)
    # 3. the primary verifies sha256 and loads with the plan's split
    payload = {
        "deployment_id": str(dep.id),
        "model_name": dep.model.name,
        "model_path": path,
        "sha256": dep.model_file.sha256,
        "rpc_endpoints": list(plan.rpc_endpoints),
        "tensor_split": list(plan.tensor_split),
        "n_gpu_layers": plan.n_gpu_layers,
        "n_ctx": plan.n_ctx,
        "n_parallel": plan.n_parallel,
        "n_threads": plan.n_threads,
        "n_batch": plan.n_batch,
        "flash_attn": plan.flash_attn,
        "memory_bytes": plan.memory_by_node().get(primary, 0),
        "rpc_tunnel_key": tunnel_key,
    }
    cid = command_send(node_id=primary, kind="load_primary", payload=payload)
    result = command_wait(command_id=cid, timeout=timeout_load)
    if result is None:
        raise _NodeLost(
            primary,
            f"primary {selectors.node_name(primary)} did not load within {timeout_load:.0f}s",
        )
    if not result.get("ok"):
        error = str(result.get("error", "load failed"))
        if "sha256" in error.lower() or "memory" in error.lower() or "missing" in error.lower():
            raise DeploymentError(f"primary refused the plan: {error}")
        raise _NodeLost(primary, f"primary {selectors.node_name(primary)} failed to load: {error}")
    event_record(
        kind="PRIMARY_LOADED",
        category=EventCategory.RUNTIME,
        now=clock(),
        node_id=primary,
        deployment_id=dep.id,
        message=f"{dep.model.name} loaded",
        data={k: v for k, v in result.items() if k != "node_id"},
    )
    # 4. every member confirmed ready (cheap re-check of their states right before READY)
    for node_id in plan.node_ids:
        _require_live(node_id)
    return {k: v for k, v in result.items() if k != "node_id"}


def _require_live(node_id: str) -> None:
    state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
    if state not in LOADABLE:
        raise _NodeLost(node_id, f"node {selectors.node_name(node_id)} is {state or 'gone'}")


def _ensure_model_file(*, dep: Deployment, node_id: str, clock: Callable[[], datetime]) -> str:
    """The primary's path to the file; copies it there first when it lacks it (retried once)."""
    replica = Replica.objects.filter(node_id=node_id, model_file=dep.model_file).first()
    if replica is not None:
        # A node's "I hold this file" is a claim: trusted only once its bytes answer a challenge.
        if replica_challenge(
            node_id=node_id,
            model_file=dep.model_file,
            path=replica.path,
            deployment_id=dep.id,
            now=clock(),
        ):
            return replica.path
        Replica.objects.filter(pk=replica.pk).delete()  # the store's copy is sent instead
    mf = dep.model_file
    url = f"{settings.CONTROLLER_PUBLIC_URL.rstrip('/')}/api/agent/models/{mf.sha256}"
    timeout = settings.MODEL_FETCH_TIMEOUT
    last_error = ""
    for attempt in (1, 2):
        event_record(
            kind="MODEL_TRANSFER_STARTED",
            category=EventCategory.PLACEMENT,
            now=clock(),
            node_id=node_id,
            deployment_id=dep.id,
            message=f"copying {mf.file_name} to the primary (attempt {attempt})",
            data={"size": mf.size},
        )
        cid = command_send(
            node_id=node_id,
            kind="fetch_model",
            payload={"sha256": mf.sha256, "file_name": mf.file_name, "size": mf.size, "url": url},
        )
        result = command_wait(command_id=cid, timeout=timeout)
        if result is None:
            raise _NodeLost(node_id, "model transfer timed out")
        if result.get("ok") and result.get("path"):
            if not replica_challenge(
                node_id=node_id,
                model_file=mf,
                path=str(result["path"]),
                deployment_id=dep.id,
                now=clock(),
            ):
                raise _NodeLost(
                    node_id, "the primary's copy of the model failed its hash challenge"
                )
            replicas_sync(
                node_id=node_id,
                files=[{"sha256": mf.sha256, "path": result["path"]}],
                now=clock(),
                prune=False,
            )
            event_record(
                kind="MODEL_TRANSFER_DONE",
                category=EventCategory.PLACEMENT,
                now=clock(),
                node_id=node_id,
                deployment_id=dep.id,
                message=f"{mf.file_name} verified on the primary",
            )
            return str(result["path"])
        last_error = str(result.get("error", "transfer failed"))
    raise DeploymentError(f"model transfer failed twice; file not used: {last_error}")


REPLICA_CHALLENGE_BYTES = 1 << 20


def replica_challenge(
    *, node_id: Any, model_file: Any, path: str, deployment_id: Any = None, now: datetime
) -> bool:
    """Whether the node's copy of a model file answers a hash challenge on a random range.

    The node returns sha256(nonce | bytes[offset:offset+length]) of its file; the controller
    computes the same from its own store copy. A fresh nonce and range each time, so no answer
    can be prepared without the bytes. Without a store copy nothing can be checked: False.
    """
    store = Path(model_file.store_path) if model_file.store_path else None
    if store is None or not store.is_file():
        event_record(
            kind="REPLICA_UNVERIFIABLE",
            category=EventCategory.SECURITY,
            now=now,
            node_id=node_id,
            deployment_id=deployment_id,
            message=f"no store copy of {model_file.file_name} to challenge the node's claim against",
        )
        return False
    size = store.stat().st_size
    length = min(REPLICA_CHALLENGE_BYTES, size)
    offset = secrets.randbelow(max(1, size - length + 1))
    nonce = secrets.token_bytes(16)
    with open(store, "rb") as f:
        f.seek(offset)
        expected = hashlib.sha256(nonce + f.read(length)).hexdigest()
    cid = command_send(
        node_id=node_id,
        kind="hash_challenge",
        payload={
            "sha256": model_file.sha256,
            "path": path,
            "offset": offset,
            "length": length,
            "nonce": nonce.hex(),
        },
    )
    result = command_wait(command_id=cid, timeout=float(settings.DEPLOYMENT_RPC_TIMEOUT))
    ok = bool(
        result and result.get("ok") and hmac.compare_digest(str(result.get("digest", "")), expected)
    )
    event_record(
        kind="REPLICA_VERIFIED" if ok else "REPLICA_CHALLENGE_FAILED",
        category=EventCategory.SECURITY,
        now=now,
        node_id=node_id,
        deployment_id=deployment_id,
        message=(
            f"{model_file.file_name}: bytes {offset}-{offset + length} "
            f"{'match' if ok else 'do not match'} the store's copy"
        ),
        data={"offset": offset, "length": length, "answered": result is not None},
    )
    return ok


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
                replacement = deployment_create(
                    model=dep.model,
                    request=PlacementRequest(**{**_request_of(dep), "exclude_nodes": (node_id,)}),
                    now=now,
                    auto=True,
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
    return _deployment_failed_replace(dep=dep, node_id=node_id, message=message, now=now)


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
        _deployment_failed_replace(
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


def _request_of(dep: Deployment) -> dict[str, Any]:
    req = dict(dep.request)
    req["pin_nodes"] = tuple(req["pin_nodes"]) if req.get("pin_nodes") else None
    req["exclude_nodes"] = tuple(req.get("exclude_nodes") or ())
    return req


PLACEMENT_LOCK_KEY = "racon:lock:placement"


def _ensure_lock_key(model_id: Any) -> str:
    return f"racon:lock:ensure:{model_id}"


@contextmanager
def _redis_lock(name: str, *, timeout: float) -> Iterator[bool]:
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


@contextmanager
def _placement_lock() -> Iterator[bool]:
    # Plans are chosen one at a time, across every worker: each sees the memory and the replicas
    # that the plans before it recorded. Two placements choosing at once both saw a free node and
    # both landed there (two READY replicas of one model on one node under `make run`). Held while
    # the plan is chosen and recorded (milliseconds), never while it loads.
    with _redis_lock(PLACEMENT_LOCK_KEY, timeout=60) as acquired:
        yield acquired


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
    with _redis_lock(_ensure_lock_key(model.id), timeout=30):
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
            replacement = _drain_replacement_locked(
                dep=draining, node_id=_draining_member(draining), now=now
            )
            if replacement is not None:
                return replacement
        return deployment_create(
            model=model, request=placement_request_from({}), now=now, auto=True
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


def deployments_drain_step(*, node_id: Any, now: datetime) -> bool:
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
        if kvcache.transfer_state(deployment_id=dep.id) == "moving":
            remaining = True  # its conversations' KV state is moving to another replica
            continue
        name = selectors.node_name(node_id)
        moved = replacement is not None and replacement.state in DEPLOYMENT_SERVING
        deployment_stop(
            deployment_id=dep.id,
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
    held = len(kvcache.slots_held(deployment_id=dep.id))
    if not held:
        return
    step = float(settings.KV_TRANSFER_TIMEOUT_SECONDS)
    n = min(held, int(settings.KV_TRANSFER_MAX_CONVERSATIONS))
    # The mark outlives every step the task may wait for, and expires if the task is lost.
    if kvcache.transfer_begin(deployment_id=dep.id, ttl=step * (1 + 2 * n) + 60):
        task_send_on_commit("racon.jobs.kv_transfer", deployment_id=str(dep.id))


def _draining_member(dep: Deployment) -> str:
    node_id = (
        Node.objects.filter(Q(deployments=dep) | Q(primary_of=dep), state__in=DRAIN_STATES)
        .values_list("id", flat=True)
        .first()
    )
    return str(node_id or dep.primary_id)


def _drain_replacement_recorded(dep: Deployment) -> tuple[bool, Deployment | None]:
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


def _drain_replacement(*, dep: Deployment, node_id: Any, now: datetime) -> Deployment | None:
    """The deployment that replaces ``dep`` off the draining node, created once (None: none can be)."""
    found, replacement = _drain_replacement_recorded(dep)
    if found:
        return replacement
    # Under the model's ensure lock, like deployment_ensure: a first request arriving during the
    # drain and the drain itself make one replacement between them.
    with _redis_lock(_ensure_lock_key(dep.model_id), timeout=30):
        return _drain_replacement_locked(dep=dep, node_id=node_id, now=now)


def _drain_replacement_locked(*, dep: Deployment, node_id: Any, now: datetime) -> Deployment | None:
    found, replacement = _drain_replacement_recorded(dep)
    if found:
        return replacement
    request = _request_of(dep)
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


def _drains_advance(*, deployments: QuerySet[Deployment], now: datetime) -> None:
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


# --- failover (docs/design/serving.md, "Failover") ---------------------------------------------
#
# The job's reader (apps/jobs/streams.py) sees its attempt end because the primary died, vanished
# or went silent. job_failover_begin records that attempt's end and stops routing to a dead
# deployment; the reader then takes a slot on another serving replica (serving.py) and
# job_failover_dispatch starts the next attempt there, resuming from the token ids relayed so far.


def job_failover_begin(
    *,
    job_id: Any,
    deployment_id: Any,
    node_id: Any,
    attempt: int,
    cause: str,
    message: str,
    chunks: int,
    completion_tokens: int,
    wait_seconds: float,
    now: datetime,
) -> bool:
    """End attempt ``attempt`` (``chunks``/``completion_tokens``: the reader's counts of it).

    The job's JobAttempt rows start here (the first from the job itself). A deployment whose
    primary died or was lost is FAILED at once (routing skips it, a replacement is placed), as a
    runtime failure report would; the old primary is told to stop in case it still runs. False
    when the job is no longer open (cancelled meanwhile): there is nothing to fail over.
    """
    job = Job.objects.filter(pk=job_id).select_related("deployment").first()
    if job is None or job.state in JOB_TERMINAL:
        return False
    admission.failover_begin(job_id=job_id, seconds=wait_seconds + 60)
    get_redis().set(job_cancel_key(str(job_id), str(node_id)), 1, ex=3600)
    dep = job.deployment
    with transaction.atomic():
        if attempt == 1 and not JobAttempt.objects.filter(job_id=job_id).exists():
            JobAttempt.objects.create(
                job_id=job_id,
                number=1,
                deployment=dep,
                primary_id=node_id,
                plan=(dep.plan if dep is not None else {}) or {},
                started_at=job.dispatched_at or job.queued_at,
            )
        JobAttempt.objects.filter(job_id=job_id, number=attempt, ended_at__isnull=True).update(
            ended_at=now,
            outcome=cause.upper(),
            error=message[:2000],
            completion_tokens=completion_tokens,
            chunks=chunks,
        )
    if cause in ("primary_died", "primary_lost", "deployment_not_loaded") and dep is not None:
        # Before the slot is given back: no waiter may take it on a dead deployment.
        _deployment_failed_replace(
            dep=dep, node_id=node_id, message=f"job {job_id}: {message}", now=now
        )
    admission.slot_release(deployment_id=deployment_id, job_id=job_id)
    return True


def _deployment_failed_replace(
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
    replacement = deployment_create(
        model=fresh.model, request=PlacementRequest(**_request_of(fresh)), now=now, auto=True
    )
    event_record(
        kind="DEPLOYMENT_REPLACED",
        category=EventCategory.PLACEMENT,
        now=now,
        deployment_id=fresh.id,
        node_id=node_id,
        message=f"replaced by {replacement.id}",
        data={"replacement": str(replacement.id)},
    )
    return True


def job_failover_left(*, job_id: Any, tokens_so_far: int) -> int:
    """Completion tokens the next attempt may still produce."""
    max_tokens = Job.objects.filter(pk=job_id).values_list("max_tokens", flat=True).first() or 0
    return int(max_tokens) - int(tokens_so_far)


def job_failover_dispatch(
    *,
    job_id: Any,
    deployment: Deployment,
    attempt: int,
    resume_tokens: list[int],
    from_deployment_id: Any,
    from_node_id: Any,
    cause: str,
    now: datetime,
    id_slot: int | None = None,
) -> dict[str, Any]:
    """Start attempt ``attempt`` on ``deployment`` (the caller holds a slot there): run_job with
    the token ids so far as ``resume_tokens`` and what is left of max_tokens, the job moved to
    the new plan, its JobAttempt row and the JOB_FAILOVER event. DeploymentError (slot given back)
    when the job ended meanwhile."""
    try:
        deployment = Deployment.objects.get(
            pk=deployment.pk
        )  # placed while the caller waited: its primary now
        job = Job.objects.only("id", "kind", "max_tokens", "params", "state").get(pk=job_id)
        left = int(job.max_tokens) - len(resume_tokens)
        if job.state in JOB_TERMINAL or left <= 0:
            raise DeploymentError("job is no longer open")
        payload = {
            **job_run_payload(
                job_id=job.id,
                deployment_id=deployment.id,
                kind=job.kind,
                max_tokens=left,
                params=job.params,
            ),
            "resume_tokens": list(resume_tokens),
            "attempt": attempt,
        }
        if id_slot is not None:  # the llama-server slot the KV coordinator pinned it to
            payload["id_slot"] = id_slot
        # An earlier attempt's failover on this same node set its cancel key (job_failover_begin):
        # left there, it would cancel this attempt as soon as the primary saw it (found by the
        # reliability suite: "The request was cancelled." after a failover back to a node).
        get_redis().delete(job_cancel_key(str(job.id), str(deployment.primary_id)))
        command_send(node_id=deployment.primary_id, kind="run_job", payload=payload)
        plan = deployment.plan or {}
        placement = dispatch_placement(deployment)
        node_ids = dispatch_node_ids(deployment)
        with transaction.atomic():
            moved = Job.objects.filter(pk=job_id, state__in=JOB_IN_FLIGHT).update(
                deployment_id=deployment.id,
                placement={"devices": placement, "primary": plan.get("primary_node_id")},
            )
            if not moved:
                raise DeploymentError("job is no longer open")
            job.nodes.add(*node_ids)  # type: ignore[arg-type]  # pks; the stubs take only int pks
            JobAttempt.objects.create(
                job_id=job_id,
                number=attempt,
                deployment=deployment,
                primary_id=deployment.primary_id,
                plan=plan,
                started_at=now,
            )
            event_record(
                kind="JOB_FAILOVER",
                category=EventCategory.EXECUTION,
                now=now,
                job_id=job_id,
                deployment_id=deployment.id,
                node_id=deployment.primary_id,
                message=(
                    f"attempt {attempt}: {cause} on deployment {from_deployment_id}; "
                    f"continues on {deployment.id} after {len(resume_tokens)} tokens"
                ),
                data={
                    "from_deployment": str(from_deployment_id),
                    "to_deployment": str(deployment.id),
                    "from_node": str(from_node_id),
                    "to_node": str(deployment.primary_id),
                    "attempt": attempt,
                    "tokens_so_far": len(resume_tokens),
                    "cause": cause,
                },
            )
    except BaseException:
        get_redis().set(job_cancel_key(str(job_id), str(deployment.primary_id)), 1, ex=3600)
        admission.slot_release(deployment_id=deployment.id, job_id=job_id)
        raise
    finally:
        admission.failover_end(job_id=job_id)
    return {
        "nodes": node_ids,
        "primary": str(deployment.primary_id),
        "n_parallel": deployment.n_parallel,
    }


def job_failover_route(
    *, model_id: Any, exclude: Collection[Any], now: datetime
) -> Deployment | None:
    """Where a failed-over job can go: the best serving replica but those excluded, else the
    model's active deployment (a replacement being placed; one is created when there is none)."""
    dep = selectors.deployment_route(model_id=model_id, exclude=exclude)
    if dep is not None:
        return Deployment.objects.get(pk=dep.pk)
    excluded = {str(e) for e in exclude}
    # Waiters poll this every second: at most one automatic placement per model per
    # FAILOVER_ENSURE_BACKOFF_SECONDS, so a placement that fails at once (no capacity) is not
    # retried in a loop that floods the model with FAILED deployments.
    if not get_redis().set(
        f"racon:model:{model_id}:failover-ensure",
        1,
        nx=True,
        ex=int(settings.FAILOVER_ENSURE_BACKOFF_SECONDS),
    ):
        pending = (
            Deployment.objects.filter(model_id=model_id, state__in=list(DEPLOYMENT_ACTIVE))
            .exclude(pk__in=list(excluded))
            .order_by("-created_at")
            .first()
        )
        return pending
    model = Model.objects.get(pk=model_id)
    ensured = deployment_ensure(model=model, now=now)
    return None if str(ensured.id) in excluded else ensured


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
                    _drains_advance,
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
