"""Writes for deployments (placement, loading, health) and jobs (dispatch, finish, cancel)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis.exceptions import LockError

from agent.protocol import job_cancel_key, new_id, node_queue_key
from apps.models_repo.models import Model, ModelFile
from apps.models_repo.profile import ModelProfile
from apps.nodes.errors import ReportRefused
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory, Node
from apps.nodes.states import NodeState
from racon import cache
from racon.logging import log_context
from racon.redis import get_redis, get_redis_blocking

from . import admission, selectors, streams
from .models import Deployment, Job
from .scheduler import CostModel, PlacementRefused, PlacementRequest, Plan, plan_placement
from .states import (
    DEPLOYMENT_ACTIVE,
    DEPLOYMENT_TRANSITIONS,
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


def command_result_accept(*, node_id: Any, command_id: str | None, payload: dict[str, Any], now: datetime) -> None:
    """Hand a command's result to whoever waits for it (placement), kept briefly for late readers."""
    if not command_id:
        raise ValueError("command_result needs command_id")
    r = get_redis()
    sent_to = r.get(_command_node_key(command_id))
    if sent_to is None:
        raise ReportRefused(f"command_result refused: command {command_id} was never sent, or its result is over {COMMAND_NODE_TTL_SECONDS}s late", code="unknown_command")
    if sent_to != str(node_id):
        raise ReportRefused(f"command_result refused: command {command_id} was sent to another node, not to node {node_id}", code="not_command_node")
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
    *, deployment_id: Any, to: str, now: datetime, expected: str | None = None, kind: str = "DEPLOYMENT_STATE_CHANGED",
    message: str = "", data: dict[str, Any] | None = None, fields: dict[str, Any] | None = None,
) -> bool:
    """Guarded move of a deployment's state with its event; a stale caller changes nothing."""
    with transaction.atomic():
        current = Deployment.objects.filter(pk=deployment_id).values_list("state", flat=True).first()
        if current is None:
            return False
        src = expected if expected is not None else current
        if current != src or to not in DEPLOYMENT_TRANSITIONS.get(src, frozenset()):
            return False
        extra = dict(fields or {})
        if to == D.READY:
            extra.setdefault("ready_at", now)
        if to == D.STOPPED:
            extra.setdefault("stopped_at", now)
        if Deployment.objects.filter(pk=deployment_id, state=src).update(state=to, **extra) != 1:
            return False
        if src != to or kind != "DEPLOYMENT_STATE_CHANGED":
            event_record(
                kind=kind, category=EventCategory.PLACEMENT, now=now, deployment_id=deployment_id,
                old_state=src, new_state=to, message=message or f"deployment {src} → {to}", data=data,
            )
    from apps.api.broadcast import broadcast  # noqa: PLC0415

    # The route candidates (READY deployments of a model) every daphne process caches.
    cache.invalidate(selectors.ROUTE_CACHE)
    transaction.on_commit(lambda: broadcast("nodes.dashboard", {"type": "deployment.changed", "deployment_id": str(deployment_id), "state": to}))
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


def deployment_preview(*, model_file: ModelFile, request: PlacementRequest, exclude_deployment: Any = None) -> Plan:
    """The plan and predictions for this model now, without loading anything."""
    profile = ModelProfile.from_dict(model_file.profile)
    snapshot = selectors.cluster_snapshot(model_file=model_file, exclude_deployment=exclude_deployment)
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


def deployment_create(*, model: Model, request: PlacementRequest, now: datetime, auto: bool = False) -> Deployment:
    """Record a deployment (PLANNING) and ask Celery to place it once this transaction commits."""
    model_file = model.files.order_by("-created_at").first()
    if model_file is None:
        raise DeploymentError(f"model {model.name!r} has no registered file")
    with transaction.atomic():
        # n_parallel left to memory is known once planned (deployment_place records the plan's).
        dep = Deployment.objects.create(
            model=model, model_file=model_file, state=D.PLANNING, request=request.to_dict(),
            n_ctx=request.n_ctx, n_parallel=request.n_parallel or 1,
        )
        event_record(
            kind="DEPLOYMENT_CREATED", category=EventCategory.PLACEMENT, now=now, deployment_id=dep.id,
            new_state=D.PLANNING, message=f"{'automatic ' if auto else ''}deployment of {model.name}",
            data={"request": request.to_dict(), "auto": auto},
        )
        from .tasks import place_deployment  # noqa: PLC0415

        place_deployment.delay_on_commit(deployment_id=str(dep.id))
    return dep


def deployment_place(*, deployment_id: Any, clock: Callable[[], datetime] = timezone.now, max_revisions: int = 3) -> Deployment:
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
            pins = (tuple(p for p in request.pin_nodes if p not in excluded) or None) if request.pin_nodes else None
            req = dataclasses.replace(request, exclude_nodes=tuple(excluded), pin_nodes=pins)
            try:
                with _placement_lock():
                    plan = deployment_preview(model_file=dep.model_file, request=req, exclude_deployment=dep.id)
                    with transaction.atomic():
                        Deployment.objects.filter(pk=dep.id).update(
                            plan=plan.to_dict(), primary_id=plan.primary_node_id, revision=revision, n_ctx=plan.n_ctx, n_parallel=plan.n_parallel,
                        )
                        dep.nodes.set(list(plan.node_ids))
                        event_record(
                            kind="PLAN_REVISED" if revision else "PLAN_CHOSEN", category=EventCategory.PLACEMENT, now=clock(),
                            deployment_id=dep.id, node_id=plan.primary_node_id,
                            message=f"primary {selectors.node_name(plan.primary_node_id)}, {len(plan.layer_devices)} device(s), {plan.n_parallel} slot(s), predicted {plan.predicted_tokens_per_s:.1f} tok/s",
                            data={"plan": plan.to_dict(), "revision": revision, "excluded": excluded},
                        )
            except PlacementRefused as exc:
                deployment_transition(deployment_id=dep.id, to=D.FAILED, now=clock(), kind="PLACEMENT_REFUSED", message=exc.reason[:500], data=exc.to_dict(), fields={"error": exc.reason})
                return Deployment.objects.get(pk=dep.id)
            deployment_transition(deployment_id=dep.id, to=D.LOADING, expected=D.PLANNING, now=clock())
            try:
                report = _deployment_load(dep=dep, plan=plan, clock=clock)
            except _NodeLost as lost:
                excluded.append(lost.node_id)
                event_record(kind="NODE_LOST_BEFORE_EXECUTION", category=EventCategory.PLACEMENT, now=clock(), deployment_id=dep.id, node_id=lost.node_id, message=lost.reason)
                if not deployment_transition(deployment_id=dep.id, to=D.PLANNING, expected=D.LOADING, now=clock(), message="re-scoring without the lost node"):
                    return Deployment.objects.get(pk=dep.id)
                continue
            except DeploymentError as exc:
                deployment_transition(deployment_id=dep.id, to=D.FAILED, expected=D.LOADING, now=clock(), kind="DEPLOYMENT_FAILED", message=str(exc)[:500], fields={"error": str(exc)})
                return Deployment.objects.get(pk=dep.id)
            except Exception as exc:
                # Never leave a deployment LOADING forever: an unexpected fault fails it, visibly.
                log.exception("placement of deployment %s failed", dep.id)
                deployment_transition(deployment_id=dep.id, to=D.FAILED, expected=D.LOADING, now=clock(), kind="DEPLOYMENT_FAILED", message=f"internal error during placement: {exc}"[:500], fields={"error": str(exc)})
                return Deployment.objects.get(pk=dep.id)
            deployment_transition(
                deployment_id=dep.id, to=D.READY, expected=D.LOADING, now=clock(), kind="DEPLOYMENT_READY",
                message="every member confirmed ready", fields={"load_report": report},
            )
            return Deployment.objects.get(pk=dep.id)
        deployment_transition(deployment_id=dep.id, to=D.FAILED, now=clock(), kind="DEPLOYMENT_FAILED", message="too many plan revisions", fields={"error": "too many plan revisions"})
        return Deployment.objects.get(pk=dep.id)


class _NodeLost(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(reason)
        self.node_id = node_id
        self.reason = reason


def _deployment_load(*, dep: Deployment, plan: Plan, clock: Callable[[], datetime]) -> dict[str, Any]:
    """Setup and validation: RPC workers, model file on the primary, primary load, member check."""
    timeout_rpc = float(getattr(settings, "DEPLOYMENT_RPC_TIMEOUT", 30))
    timeout_load = float(getattr(settings, "DEPLOYMENT_LOAD_TIMEOUT", 300))
    # 1. start or confirm the RPC workers of the plan, and let only this plan's primary through
    # their tunnels: a fresh key per deployment (and placement attempt), never stored, sent only
    # in the commands of the plan's members.
    tunnel_key = secrets.token_hex(32)
    primary_address = Node.objects.filter(pk=plan.primary_node_id).values_list("address", flat=True).first()
    for worker in plan.rpc_workers():
        node_id = worker["node_id"]
        _require_live(node_id)
        grant = {"deployment_id": str(dep.id), "tunnel_key": tunnel_key, "primary_address": primary_address}
        cid = command_send(node_id=node_id, kind="rpc_start", payload=grant)
        result = command_wait(command_id=cid, timeout=timeout_rpc)
        if result is None:
            raise _NodeLost(node_id, f"RPC worker on {selectors.node_name(node_id)} did not confirm within {timeout_rpc:.0f}s")
        if not result.get("ok"):
            raise _NodeLost(node_id, f"RPC worker on {selectors.node_name(node_id)} failed: {result.get('error', '')}")
        event_record(kind="RPC_WORKER_CONFIRMED", category=EventCategory.RUNTIME, now=clock(), node_id=node_id, deployment_id=dep.id, message=f"RPC worker ready at {worker['endpoint']}", data={"endpoint": worker["endpoint"], "result": {k: v for k, v in result.items() if k != "node_id"}})
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
        raise _NodeLost(primary, f"primary {selectors.node_name(primary)} did not load within {timeout_load:.0f}s")
    if not result.get("ok"):
        error = str(result.get("error", "load failed"))
        if "sha256" in error.lower() or "memory" in error.lower() or "missing" in error.lower():
            raise DeploymentError(f"primary refused the plan: {error}")
        raise _NodeLost(primary, f"primary {selectors.node_name(primary)} failed to load: {error}")
    event_record(kind="PRIMARY_LOADED", category=EventCategory.RUNTIME, now=clock(), node_id=primary, deployment_id=dep.id, message=f"{dep.model.name} loaded", data={k: v for k, v in result.items() if k != "node_id"})
    # 4. every member confirmed ready (cheap re-check of their states right before READY)
    for node_id in plan.node_ids:
        _require_live(node_id)
    return {k: v for k, v in result.items() if k != "node_id"}


def _require_live(node_id: str) -> None:
    state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
    if state not in (NodeState.READY, NodeState.BUSY, NodeState.DEGRADED):
        raise _NodeLost(node_id, f"node {selectors.node_name(node_id)} is {state or 'gone'}")


def _ensure_model_file(*, dep: Deployment, node_id: str, clock: Callable[[], datetime]) -> str:
    """The primary's path to the file; copies it there first when it lacks it (retried once)."""
    from apps.models_repo.models import Replica  # noqa: PLC0415

    replica = Replica.objects.filter(node_id=node_id, model_file=dep.model_file).first()
    if replica is not None:
        # A node's "I hold this file" is a claim: trusted only once its bytes answer a challenge.
        if replica_challenge(node_id=node_id, model_file=dep.model_file, path=replica.path, deployment_id=dep.id, now=clock()):
            return replica.path
        Replica.objects.filter(pk=replica.pk).delete()  # the store's copy is sent instead
    mf = dep.model_file
    url = f"{settings.CONTROLLER_PUBLIC_URL.rstrip('/')}/api/agent/models/{mf.sha256}"
    timeout = float(getattr(settings, "MODEL_FETCH_TIMEOUT", 1800))
    last_error = ""
    for attempt in (1, 2):
        event_record(kind="MODEL_TRANSFER_STARTED", category=EventCategory.PLACEMENT, now=clock(), node_id=node_id, deployment_id=dep.id, message=f"copying {mf.file_name} to the primary (attempt {attempt})", data={"size": mf.size})
        cid = command_send(node_id=node_id, kind="fetch_model", payload={"sha256": mf.sha256, "file_name": mf.file_name, "size": mf.size, "url": url})
        result = command_wait(command_id=cid, timeout=timeout)
        if result is None:
            raise _NodeLost(node_id, "model transfer timed out")
        if result.get("ok") and result.get("path"):
            from apps.models_repo.services import replicas_sync  # noqa: PLC0415

            if not replica_challenge(node_id=node_id, model_file=mf, path=str(result["path"]), deployment_id=dep.id, now=clock()):
                raise _NodeLost(node_id, "the primary's copy of the model failed its hash challenge")
            replicas_sync(node_id=node_id, files=[{"sha256": mf.sha256, "path": result["path"]}], now=clock(), prune=False)
            event_record(kind="MODEL_TRANSFER_DONE", category=EventCategory.PLACEMENT, now=clock(), node_id=node_id, deployment_id=dep.id, message=f"{mf.file_name} verified on the primary")
            return str(result["path"])
        last_error = str(result.get("error", "transfer failed"))
    raise DeploymentError(f"model transfer failed twice; file not used: {last_error}")


REPLICA_CHALLENGE_BYTES = 1 << 20


def replica_challenge(*, node_id: Any, model_file: Any, path: str, deployment_id: Any = None, now: datetime) -> bool:
    """Whether the node's copy of a model file answers a hash challenge on a random range.

    The node returns sha256(nonce | bytes[offset:offset+length]) of its file; the controller
    computes the same from its own store copy. A fresh nonce and range each time, so no answer
    can be prepared without the bytes. Without a store copy nothing can be checked: False.
    """
    store = Path(model_file.store_path) if model_file.store_path else None
    if store is None or not store.is_file():
        event_record(kind="REPLICA_UNVERIFIABLE", category=EventCategory.SECURITY, now=now, node_id=node_id, deployment_id=deployment_id, message=f"no store copy of {model_file.file_name} to challenge the node's claim against")
        return False
    size = store.stat().st_size
    length = min(REPLICA_CHALLENGE_BYTES, size)
    offset = secrets.randbelow(max(1, size - length + 1))
    nonce = secrets.token_bytes(16)
    with open(store, "rb") as f:
        f.seek(offset)
        expected = hashlib.sha256(nonce + f.read(length)).hexdigest()
    cid = command_send(node_id=node_id, kind="hash_challenge", payload={"sha256": model_file.sha256, "path": path, "offset": offset, "length": length, "nonce": nonce.hex()})
    result = command_wait(command_id=cid, timeout=float(settings.DEPLOYMENT_RPC_TIMEOUT))
    ok = bool(result and result.get("ok") and hmac.compare_digest(str(result.get("digest", "")), expected))
    event_record(
        kind="REPLICA_VERIFIED" if ok else "REPLICA_CHALLENGE_FAILED", category=EventCategory.SECURITY, now=now, node_id=node_id, deployment_id=deployment_id,
        message=f"{model_file.file_name}: bytes {offset}-{offset + length} {'match' if ok else 'do not match'} the store's copy",
        data={"offset": offset, "length": length, "answered": result is not None},
    )
    return ok


def deployment_stop(*, deployment_id: Any, now: datetime, reason: str = "stopped by operator") -> Deployment:
    """Stop a deployment: unload its primary; running jobs are cancelled."""
    dep = Deployment.objects.get(pk=deployment_id)
    if dep.state == D.STOPPED:
        return dep
    if dep.state == D.FAILED or deployment_transition(deployment_id=dep.id, to=D.STOPPED, now=now, kind="DEPLOYMENT_STOPPED", message=reason):
        if dep.state == D.FAILED:
            deployment_transition(deployment_id=dep.id, to=D.STOPPED, now=now, kind="DEPLOYMENT_STOPPED", message=reason)
        if dep.primary_id:
            command_send(node_id=dep.primary_id, kind="unload", payload={"deployment_id": str(dep.id)})
        for job_id in Job.objects.filter(deployment=dep, state__in=[J.QUEUED, J.DISPATCHED, J.RUNNING]).values_list("id", flat=True):
            job_cancel(job_id=job_id, now=now, reason="deployment stopped")
    dep.refresh_from_db()
    return dep


def deployments_on_node_state(*, node_id: str, state: str, now: datetime) -> None:
    """A member node changed health: degrade, fail and replace, or restore its deployments."""
    deps = list(Deployment.objects.filter(nodes__id=node_id, state__in=list(DEPLOYMENT_ACTIVE)).select_related("model"))
    for dep in deps:
        if state == NodeState.DEGRADED and dep.state == D.READY:
            deployment_transition(deployment_id=dep.id, to=D.DEGRADED, expected=D.READY, now=now, kind="DEPLOYMENT_DEGRADED", message=f"member {selectors.node_name(node_id)} degraded")
        elif state == NodeState.READY and dep.state == D.DEGRADED:
            members_ok = not Node.objects.filter(pk__in=dep.nodes.values("id")).exclude(state__in=[NodeState.READY, NodeState.BUSY, NodeState.DRAINING]).exists()
            if members_ok:
                deployment_transition(deployment_id=dep.id, to=D.READY, expected=D.DEGRADED, now=now, kind="DEPLOYMENT_RESTORED", message="all members healthy again")
        elif state in (NodeState.OFFLINE, NodeState.ERROR) and dep.state in (D.READY, D.DEGRADED):
            if deployment_transition(deployment_id=dep.id, to=D.FAILED, now=now, kind="DEPLOYMENT_FAILED", message=f"member {selectors.node_name(node_id)} is {state}", fields={"error": f"member node {node_id} {state}"}):
                for job_id in Job.objects.filter(deployment=dep, state__in=[J.QUEUED, J.DISPATCHED, J.RUNNING]).values_list("id", flat=True):
                    job_fail(job_id=job_id, now=now, error=f"a node of the plan went {state} during execution", during_execution=True)
                if dep.primary_id and str(dep.primary_id) != node_id:
                    command_send(node_id=dep.primary_id, kind="unload", payload={"deployment_id": str(dep.id)})
                # Replace it: a new placement without the lost node.
                replacement = deployment_create(model=dep.model, request=PlacementRequest(**{**_request_of(dep), "exclude_nodes": (node_id,)}), now=now, auto=True)
                event_record(kind="DEPLOYMENT_REPLACED", category=EventCategory.PLACEMENT, now=now, deployment_id=dep.id, node_id=node_id, message=f"replaced by {replacement.id}", data={"replacement": str(replacement.id)})
        elif state in (NodeState.OFFLINE, NodeState.ERROR) and dep.state in (D.PLANNING, D.LOADING):
            pass  # the placement task sees the lost node and re-scores (PLAN_REVISED)


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
        raise ReportRefused(f"node {node_id} is not a member of deployment {dep_id}'s plan", code="not_plan_member")
    return dep


def job_primary_check(*, job_id: Any, node_id: Any) -> uuid.UUID:
    """The job's id, if the node is the primary of its plan (the one that runs it); ReportRefused if not."""
    job_uuid = _uuid_or_refuse(job_id, what="job_id")
    job = Job.objects.filter(pk=job_uuid).values("placement", "deployment__primary_id").first()
    if job is None:
        raise ValueError(f"unknown job {job_uuid}")
    primaries = {str(p) for p in (job["deployment__primary_id"], (job["placement"] or {}).get("primary")) if p}
    if str(node_id) not in primaries:
        raise ReportRefused(f"node {node_id} is not the primary of job {job_uuid}'s plan", code="not_plan_member")
    return job_uuid


def deployment_runtime_failed(*, deployment_id: Any, node_id: Any, message: str, now: datetime) -> bool:
    """The primary process died (an RPC peer crashed, or it aborted): FAILED, jobs failed, replaced.

    Only a member of the deployment's plan may say so (ReportRefused otherwise; nothing changes).
    """
    dep = deployment_member_check(deployment_id=deployment_id, node_id=node_id)
    if dep.state not in (D.READY, D.DEGRADED):
        return False  # while LOADING, the placement task owns failures (and re-plans)
    if not deployment_transition(deployment_id=dep.id, to=D.FAILED, expected=dep.state, now=now, kind="DEPLOYMENT_FAILED", message=message[:500], fields={"error": message[:2000]}):
        return False
    for job_id in Job.objects.filter(deployment=dep, state__in=[J.QUEUED, J.DISPATCHED, J.RUNNING]).values_list("id", flat=True):
        job_fail(job_id=job_id, now=now, error=f"runtime failure during execution: {message}", during_execution=True)
    replacement = deployment_create(model=dep.model, request=PlacementRequest(**_request_of(dep)), now=now, auto=True)
    event_record(kind="DEPLOYMENT_REPLACED", category=EventCategory.PLACEMENT, now=now, deployment_id=dep.id, node_id=node_id, message=f"replaced by {replacement.id}", data={"replacement": str(replacement.id)})
    return True


def links_probe_request(*, node_id: Any, max_peers: int = 32) -> str | None:
    """Ask a node that just became READY to measure its links to the other live nodes."""
    peers = [
        {"node_id": str(n.id), "address": n.address, "rpc_port": n.rpc_port}
        for n in Node.objects.filter(state__in=[NodeState.READY, NodeState.BUSY]).exclude(pk=node_id).only("id", "address", "rpc_port")[:max_peers]
    ]
    if not peers:
        return None
    return command_send(node_id=node_id, kind="probe_links", payload={"peers": peers})


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
    """
    def active() -> Deployment | None:
        return Deployment.objects.filter(model=model, state__in=list(DEPLOYMENT_ACTIVE)).order_by("-created_at").first()

    existing = active()
    if existing is not None:
        return existing
    with _redis_lock(_ensure_lock_key(model.id), timeout=30):
        existing = active()
        if existing is not None:
            return existing
        return deployment_create(model=model, request=placement_request_from({}), now=now, auto=True)


# --- jobs ---------------------------------------------------------------------------------------


def job_transition(
    *, job_id: Any, to: str, now: datetime, expected: str | None = None, fields: dict[str, Any] | None = None,
    kind: str | None = None, message: str = "", data: dict[str, Any] | None = None,
) -> bool:
    """Guarded move of a job's state; writes its event. Terminal states are final."""
    with transaction.atomic():
        current = Job.objects.filter(pk=job_id).values_list("state", flat=True).first()
        if current is None:
            return False
        src = expected if expected is not None else current
        if current != src or to not in JOB_TRANSITIONS.get(src, frozenset()):
            return False
        if Job.objects.filter(pk=job_id, state=src).update(state=to, **(fields or {})) != 1:
            return False
        if kind:
            event_record(kind=kind, category=EventCategory.EXECUTION, now=now, job_id=job_id, deployment_id=(fields or {}).get("deployment_id"), old_state=src, new_state=to, message=message, data=data)
    return True


def job_create(
    *, model: Model, account_id: Any, api_key_id: Any, kind: str, params: dict[str, Any], max_tokens: int,
    stream: bool, request_id: str, now: datetime, job_id: Any = None, dispatched_to: Deployment | None = None,
) -> Job:
    """Record a QUEUED job and reserve credits for it (InsufficientCredits propagates; nothing stays).

    With dispatched_to, the job's run_job was already pushed to that deployment's primary (the
    fast path): the same transaction records the dispatch, so the row, the hold and
    JOB_DISPATCHED are written while the primary evaluates the prompt.
    """
    from apps.credits.services import credit_reserve  # noqa: PLC0415

    with transaction.atomic():
        job = Job.objects.create(
            id=job_id or uuid.uuid4(), model=model, account_id=account_id, api_key_id=api_key_id, kind=kind, params=params,
            max_tokens=max_tokens, stream=stream, request_id=request_id, queued_at=now, state=J.QUEUED,
        )
        if account_id is not None:
            credit_reserve(account_id=account_id, job_id=job.id, max_tokens=max_tokens, model_price_permille=model.price_weight_permille, now=now)
        if dispatched_to is not None and not _record_dispatch(job=job, deployment=dispatched_to, now=now):
            raise DeploymentError("job is no longer queued")
    return job


def job_run_payload(*, job_id: Any, deployment_id: Any, kind: str, max_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    """The run_job command's payload (protocol.RunJobPayload)."""
    return {"job_id": str(job_id), "deployment_id": str(deployment_id), "kind": kind, "max_tokens": max_tokens, **params}


def _record_dispatch(*, job: Job, deployment: Deployment, now: datetime) -> bool:
    """QUEUED → DISPATCHED with the plan's nodes and layers (the JOB_DISPATCHED event)."""
    plan = deployment.plan or {}
    placement = [
        {"node_id": d["node_id"], "node": selectors.node_name(d["node_id"]), "device": d["device"], "layers": [d["layer_start"], d["layer_end"]]}
        for d in plan.get("devices", [])
    ]
    node_ids = list(dict.fromkeys(d["node_id"] for d in plan.get("devices", [])))
    with transaction.atomic():
        moved = job_transition(
            job_id=job.id, to=J.DISPATCHED, expected=J.QUEUED, now=now,
            fields={"deployment_id": deployment.id, "dispatched_at": now, "placement": {"devices": placement, "primary": plan.get("primary_node_id")}},
            kind="JOB_DISPATCHED", message=f"to deployment {deployment.id}", data={"nodes": node_ids},
        )
        if moved:
            job.nodes.set(node_ids)
    return moved


def job_dispatch(*, job_id: Any, deployment: Deployment, now: datetime) -> dict[str, Any]:
    """QUEUED → DISPATCHED: push run_job onto the primary's queue, then record the plan's nodes.

    The push goes first: the primary starts on the prompt while the transition is written. If the
    job stopped being QUEUED meanwhile (cancelled), the primary is told to cancel it.
    The caller holds a slot for the job (admission); any failure here gives it back.
    """
    try:
        job = Job.objects.only("id", "kind", "max_tokens", "params").get(pk=job_id)
        payload = job_run_payload(job_id=job.id, deployment_id=deployment.id, kind=job.kind, max_tokens=job.max_tokens, params=job.params)
        command_send(node_id=deployment.primary_id, kind="run_job", payload=payload)
        if not _record_dispatch(job=job, deployment=deployment, now=now):
            get_redis().set(job_cancel_key(str(job.id), str(deployment.primary_id)), 1, ex=3600)
            raise DeploymentError("job is no longer queued")
    except BaseException:
        admission.slot_release(deployment_id=deployment.id, job_id=job_id)
        raise
    return {"nodes": dispatch_node_ids(deployment), "primary": str(deployment.primary_id)}


def dispatch_node_ids(deployment: Deployment) -> list[str]:
    return list(dict.fromkeys(d["node_id"] for d in (deployment.plan or {}).get("devices", [])))


def job_mark_running(*, job_id: Any, now: datetime) -> bool:
    """DISPATCHED → RUNNING at the first token."""
    return job_transition(job_id=job_id, to=J.RUNNING, expected=J.DISPATCHED, now=now, fields={"first_token_at": now})


def _finish(*, job_id: Any, to: str, now: datetime, fields: dict[str, Any], kind: str, message: str) -> bool:
    job = Job.objects.filter(pk=job_id).values("state", "deployment_id").first()
    if job is None or job["state"] in JOB_TERMINAL:
        return False
    moved = job_transition(job_id=job_id, to=to, now=now, fields={"finished_at": now, **fields}, kind=kind, message=message)
    if moved:
        if job["deployment_id"]:
            admission.slot_release(deployment_id=job["deployment_id"], job_id=job_id)
        from apps.credits.tasks import settle_job  # noqa: PLC0415

        settle_job.delay_on_commit(job_id=str(job_id))
        _record_job_metrics(job_id=job_id, to=to, fields=fields)
    return moved


def _record_job_metrics(*, job_id: Any, to: str, fields: dict[str, Any]) -> None:
    from apps.api.metrics import job_finished_observe  # noqa: PLC0415

    job_finished_observe(job_id=job_id, state=to, fields=fields)


def job_complete(*, job_id: Any, usage: dict[str, Any], finish_reason: str, chunks: int, now: datetime, device_seconds: dict[str, float] | None = None) -> bool:
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
    return _finish(job_id=job_id, to=J.COMPLETED, now=now, fields=fields, kind="JOB_COMPLETED", message=f"{fields['completion_tokens']} tokens, {fields['finish_reason']}")


def job_fail(*, job_id: Any, now: datetime, error: str, during_execution: bool | None = None, usage: dict[str, Any] | None = None, chunks: int | None = None) -> bool:
    """→ FAILED with the error; only what was delivered is charged."""
    fields: dict[str, Any] = {"error": error[:2000], "failed_during_execution": during_execution, "finish_reason": "error"}
    if usage:
        fields["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        fields["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    if chunks is not None:
        fields["stream_chunks"] = chunks
    return _finish(job_id=job_id, to=J.FAILED, now=now, fields=fields, kind="JOB_FAILED", message=error[:300])


def job_cancel(*, job_id: Any, now: datetime, reason: str = "cancelled", usage: dict[str, Any] | None = None, chunks: int | None = None) -> bool:
    """→ CANCELLED; sets the cancel flag the primary checks between tokens."""
    job = Job.objects.filter(pk=job_id).select_related("deployment").first()
    if job is not None and job.deployment_id and job.deployment.primary_id and job.state in (J.DISPATCHED, J.RUNNING):
        get_redis().set(job_cancel_key(str(job_id), str(job.deployment.primary_id)), 1, ex=3600)
        command_send(node_id=job.deployment.primary_id, kind="cancel_job", payload={"job_id": str(job_id)})
    fields: dict[str, Any] = {"finish_reason": "cancelled", "error": reason[:2000]}
    if usage:
        fields["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        fields["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    if chunks is not None:
        fields["stream_chunks"] = chunks
    return _finish(job_id=job_id, to=J.CANCELLED, now=now, fields=fields, kind="JOB_CANCELLED", message=reason[:300])


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
    job = Job.objects.filter(pk=job_id).values("state", "kind", "params").first()
    if job is None or job["state"] in JOB_TERMINAL:
        return  # the stream reader (or a sweep) finished it first, as it usually does
    claimed = {k: payload.get(k) for k in ("prompt_tokens", "completion_tokens", "ttft_ms", "tokens_per_s") if payload.get(k) is not None}
    chunks, tokens = streams.stream_tally(job_id, node_id)
    usage = streams.billed_usage(
        completion_tokens=tokens, agent_usage=claimed, prompt_bound=streams.prompt_token_bound(kind=job["kind"], params=job["params"] or {}),
        job_id=job_id, check=status == "completed",
    )
    if status == "completed":
        job_complete(job_id=job_id, usage=usage, finish_reason=payload.get("finish_reason") or "stop", chunks=chunks, now=now, device_seconds=payload.get("device_seconds"))
    elif status == "failed":
        job_fail(job_id=job_id, now=now, error=str(payload.get("error") or "failed on the node"), during_execution=True, usage=usage, chunks=chunks)
    else:
        job_cancel(job_id=job_id, now=now, reason=str(payload.get("error") or "cancelled on the node"), usage=usage, chunks=chunks)


def jobs_fail_stale(*, now: datetime) -> dict[str, int]:
    """Close jobs nobody will finish: never dispatched, or silent far past the stream idle limit.

    A job whose stream already ended (the reader died after the last entry) is finished from that
    entry, so credits are settled for what was delivered and no hold stays open.
    """
    from agent.protocol import job_stream_key  # noqa: PLC0415

    idle = float(settings.STREAM_IDLE_TIMEOUT_SECONDS) * 2
    queued_limit = float(settings.DEPLOYMENT_WAIT_SECONDS) + float(settings.JOB_QUEUE_WAIT_SECONDS) + 60
    r = get_redis()
    counts = {"queued": 0, "silent": 0, "finished_from_stream": 0}
    cutoff_q = now.timestamp() - queued_limit
    for job in Job.objects.filter(state=J.QUEUED).only("id", "queued_at", "deployment_id"):
        if job.queued_at.timestamp() < cutoff_q:
            if job_fail(job_id=job.id, now=now, error="never dispatched: no capacity in time", during_execution=False):
                counts["queued"] += 1
    running = Job.objects.filter(state__in=[J.DISPATCHED, J.RUNNING]).select_related("deployment").only(
        "id", "dispatched_at", "queued_at", "kind", "params", "deployment__primary_id"
    )
    for job in running:
        node = str(job.deployment.primary_id) if job.deployment_id and job.deployment.primary_id else ""
        last = r.xrevrange(job_stream_key(str(job.id), node), count=1) if node else []
        if last:
            entry_id, fields = last[0]
            if fields.get("type") in ("done", "error"):
                # Billed on the controller's own count of the stream, as the follower would have.
                chunks, tokens = streams.stream_tally(job.id, node)
                usage = streams.billed_usage(completion_tokens=tokens, agent_usage=streams.entry_usage(fields), prompt_bound=streams.prompt_token_bound(kind=job.kind, params=job.params), job_id=job.id)
                if fields.get("type") == "done" and fields.get("finish_reason") != "cancelled":
                    done = job_complete(job_id=job.id, usage=usage, finish_reason=fields.get("finish_reason") or "stop", chunks=chunks, now=now)
                elif fields.get("type") == "done":
                    done = job_cancel(job_id=job.id, now=now, reason="cancelled", usage=usage, chunks=chunks)
                else:
                    done = job_fail(job_id=job.id, now=now, error=fields.get("text") or "failed", during_execution=True, usage=usage, chunks=chunks)
                counts["finished_from_stream"] += int(done)
                continue
            last_ts = int(entry_id.split("-")[0]) / 1000.0
        else:
            last_ts = (job.dispatched_at or job.queued_at).timestamp()
        if now.timestamp() - last_ts > idle:
            if job_fail(job_id=job.id, now=now, error=f"no output for {idle:.0f}s; the primary is gone", during_execution=True):
                counts["silent"] += 1
    return counts
