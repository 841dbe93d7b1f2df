"""Writes for deployments: create, preview, stop, replace, follow their nodes' states, and
ensure one exists for a model (with the drain helpers that a first request and placement share).

Imports the job lifecycle (jobs.py) to fail or cancel a deployment's jobs, never the reverse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import replace
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from apps.models_repo.models import Model, ModelFile
from apps.models_repo.profile import ModelProfile
from apps.nodes.commands import command_send
from apps.nodes.errors import ReportRefused
from apps.nodes.events import event_record
from apps.nodes.models import Event, EventCategory, Node
from apps.nodes.states import DRAIN_STATES, HEALTHY, LOST, NodeState
from racon import cache, ids
from racon.broadcast import broadcast
from racon.celery import task_send_on_commit
from racon.ids import DeploymentId, ModelId, NodeId
from racon.locks import redis_lock
from racon.redis import get_redis
from racon.transitions import transition_guarded

from . import admission, kvcache, selectors
from .jobs import DeploymentError, _uuid_or_refuse, job_cancel, job_fail
from .models import Deployment, Job
from .scheduler import (
    CostModel,
    PlacementRefused,
    PlacementRequest,
    Plan,
    VllmModel,
    choose_engine,
    plan_placement,
    plan_vllm,
)
from .states import (
    DEPLOYMENT_ACTIVE,
    DEPLOYMENT_PENDING,
    DEPLOYMENT_SERVING,
    DEPLOYMENT_TRANSITIONS,
    JOB_OPEN,
    DeploymentState,
)

log = logging.getLogger("racon.jobs")
D = DeploymentState


# --- deployments -----------------------------------------------------------------------------


def deployment_transition(
    *,
    deployment_id: DeploymentId,
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
        pin_devices=tuple(str(d) for d in data["devices"]) if data.get("devices") else None,
        primary=str(data["primary"]) if data.get("primary") else None,
        engine=str(data.get("engine") or "llamacpp"),
    )


def engine_unavailable(model: Model, engine: str) -> str | None:
    """Why ``engine`` cannot serve ``model`` at all (the API's 400, the UI's error), or None."""
    if engine != "vllm":
        return None
    if not model.files.filter(format__iexact="safetensors").exists():
        formats = sorted({f.upper() for f in model.files.values_list("format", flat=True)})
        return (
            f"model {model.name!r} has only {'/'.join(formats) or 'no'} files: vLLM on the CPU "
            "cannot run GGUF; register its safetensors model directory first "
            "(racon models add DIR)"
        )
    # JSON containment is PostgreSQL's (SQLite has none): the inventories are read here.
    inventories = Node.objects.filter(revoked_at__isnull=True).values_list("hardware", flat=True)
    if not any("vllm" in ((hw or {}).get("engines") or []) for hw in inventories):
        return (
            "no node has the vLLM engine: on a node, run scripts/install-vllm.sh and start its "
            "agent with RACON_ENGINES=llamacpp,vllm"
        )
    return None


def engine_model_file(model: Model, engine: str) -> ModelFile | None:
    """The file an engine serves: vLLM the model's safetensors directory, llama.cpp its newest
    other file (the GGUF)."""
    files = model.files.order_by("-created_at")
    if engine == "vllm":
        return files.filter(format="safetensors").first()
    return files.exclude(format="safetensors").first()


def vllm_model_of(model_file: ModelFile) -> VllmModel:
    """A model directory's figures for a vLLM plan (config.json, recorded at registration)."""
    return VllmModel.from_config(
        size=model_file.size,
        dtype=model_file.quantization,
        n_layer=model_file.n_layer,
        n_embd=model_file.n_embd,
        n_head=model_file.n_head,
        n_head_kv=model_file.n_head_kv,
        n_ctx_train=model_file.n_ctx_train,
    )


def deployment_preview(
    *, model_file: ModelFile, request: PlacementRequest, exclude_deployment: Any = None
) -> Plan:
    """The plan and predictions for this model now, without loading anything. A vLLM request
    (engine vllm, a safetensors model_file) gets a one-node plan (scheduler/vllm.py)."""
    snapshot = selectors.cluster_snapshot(
        model_file=model_file, exclude_deployment=exclude_deployment
    )
    t0 = time.perf_counter()
    try:
        if request.engine == "vllm":
            return plan_vllm(vllm_model_of(model_file), snapshot, request)
        profile = ModelProfile.from_dict(model_file.profile)
        return plan_placement(profile, snapshot, request, cost=scheduler_cost_model())
    finally:
        _record_placement_latency(time.perf_counter() - t0)


def deployment_plan(
    *, model: Model, request: PlacementRequest, exclude_deployment: Any = None
) -> tuple[Plan, ModelFile, PlacementRequest]:
    """The plan for a deployment of ``model``, the file it serves, and the request with its
    engine settled. ``request.engine`` "auto" (the operator named none): the scheduler plans
    both engines and picks one (scheduler.choose_engine), its reason first in the plan's
    explanation; a named engine is planned as is (PlacementRefused when it cannot be placed;
    DeploymentError when the model has no file for it)."""
    if request.engine != "auto":
        model_file = engine_model_file(model, request.engine)
        if model_file is None:
            raise DeploymentError(f"model {model.name!r} has no registered file")
        plan = deployment_preview(
            model_file=model_file, request=request, exclude_deployment=exclude_deployment
        )
        return plan, model_file, request
    tried: dict[str, tuple[ModelFile, Plan | PlacementRefused] | None] = {}
    for engine in ("vllm", "llamacpp"):
        mf = engine_model_file(model, engine)
        if mf is None:
            tried[engine] = None
            continue
        asked = replace(request, engine=engine)
        try:
            tried[engine] = (
                mf,
                deployment_preview(
                    model_file=mf, request=asked, exclude_deployment=exclude_deployment
                ),
            )
        except PlacementRefused as exc:
            tried[engine] = (mf, exc)
    vllm, llama = tried["vllm"], tried["llamacpp"]
    engine, why = choose_engine(
        vllm=vllm[1] if vllm else None,
        llamacpp=llama[1] if llama else None,
        min_parallel=int(settings.VLLM_AUTO_MIN_PARALLEL),
    )
    chosen = tried[engine]
    if chosen is None:
        raise DeploymentError(f"model {model.name!r} has no registered file")
    model_file, outcome = chosen
    if isinstance(outcome, PlacementRefused):
        raise outcome
    plan = replace(outcome, explanation=(why, *outcome.explanation))
    return plan, model_file, replace(request, engine=engine)


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
    *,
    model: Model,
    request: PlacementRequest,
    now: datetime,
    auto: bool = False,
    engine_reason: str | None = None,
) -> Deployment:
    """Record a deployment (PLANNING) and ask Celery to place it once this transaction commits.

    ``request.engine`` "auto": the scheduler picks the engine now (deployment_plan), and the
    event says which and why; a model neither engine can place gets llama.cpp, whose placement
    then fails with its own reason, as before. ``engine_reason``: why the scheduler chose the
    engine of a request settled already (the API's deployment_plan)."""
    engine_why = engine_reason
    if request.engine == "auto":
        try:
            plan, _, request = deployment_plan(model=model, request=request)
            engine_why = plan.explanation[0]
        except PlacementRefused:
            request = replace(request, engine="llamacpp")
    model_file = engine_model_file(model, request.engine)
    if model_file is None:
        raise DeploymentError(f"model {model.name!r} has no registered file")
    with transaction.atomic():
        # n_parallel left to memory is known once planned (deployment_place records the plan's).
        dep = Deployment.objects.create(
            model=model,
            model_file=model_file,
            engine=request.engine,
            state=D.PLANNING,
            request=request.to_dict(),
            n_ctx=request.n_ctx,
            n_parallel=request.n_parallel or 1,
        )
        event_record(
            kind="DEPLOYMENT_CREATED",
            category=EventCategory.PLACEMENT,
            now=now,
            deployment_id=ids.deployment_id(dep.id),
            new_state=D.PLANNING,
            message=f"{'automatic ' if auto else ''}deployment of {model.name}",
            data={
                "request": request.to_dict(),
                "auto": auto,
                **({"engine_reason": engine_why} if engine_why else {}),
            },
        )
        task_send_on_commit("racon.jobs.place_deployment", deployment_id=str(dep.id))
    return dep


def deployment_stop(
    *, deployment_id: DeploymentId, now: datetime, reason: str = "stopped by operator"
) -> Deployment:
    """Stop a deployment: unload its primary; running jobs are cancelled."""
    dep = Deployment.objects.get(pk=deployment_id)
    if dep.state == D.STOPPED:
        return dep
    if dep.state == D.FAILED or deployment_transition(
        deployment_id=ids.deployment_id(dep.id),
        to=D.STOPPED,
        now=now,
        kind="DEPLOYMENT_STOPPED",
        message=reason,
    ):
        if dep.state == D.FAILED:
            deployment_transition(
                deployment_id=ids.deployment_id(dep.id),
                to=D.STOPPED,
                now=now,
                kind="DEPLOYMENT_STOPPED",
                message=reason,
            )
        if dep.primary_id:
            command_send(
                node_id=ids.node_id(dep.primary_id),
                kind="unload",
                payload={"deployment_id": str(dep.id)},
            )
        # Its slots' KV state goes with the process: whatever was not moved is dropped, said so.
        kvcache.deployment_drop(
            deployment_id=ids.deployment_id(dep.id), reason=f"the replica stopped ({reason})"
        )
        for job_id in Job.objects.filter(deployment=dep, state__in=JOB_OPEN).values_list(
            "id", flat=True
        ):
            job_cancel(job_id=ids.job_id(job_id), now=now, reason="deployment stopped")
    dep.refresh_from_db()
    return dep


def deployments_on_node_state(*, node_id: NodeId, state: str, now: datetime) -> None:
    """A member node changed health: degrade, fail and replace, or restore its deployments."""
    deps = list(
        Deployment.objects.filter(
            nodes__id=node_id, state__in=list(DEPLOYMENT_ACTIVE)
        ).select_related("model")
    )
    for dep in deps:
        if state == NodeState.DEGRADED and dep.state == D.READY:
            deployment_transition(
                deployment_id=ids.deployment_id(dep.id),
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
                    deployment_id=ids.deployment_id(dep.id),
                    to=D.READY,
                    expected=D.DEGRADED,
                    now=now,
                    kind="DEPLOYMENT_RESTORED",
                    message="all members healthy again",
                )
        elif state in LOST and dep.state in DEPLOYMENT_SERVING:
            if deployment_transition(
                deployment_id=ids.deployment_id(dep.id),
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
                        node_id=ids.node_id(dep.primary_id),
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
        if admission.job_reader_live(
            deployment_id=ids.deployment_id(dep.id), job_id=ids.job_id(job_id)
        ):
            log.info("job %s: deployment %s failed; its reader fails it over", job_id, dep.id)
            continue
        job_fail(job_id=ids.job_id(job_id), now=now, error=error, during_execution=True)


def deployment_failed_replace(
    *, dep: Deployment, node_id: NodeId, message: str, now: datetime
) -> bool:
    """A serving deployment whose primary died: FAILED (routing skips it), its unread jobs failed,
    and replaced, once. False when it had already left serving (another report got there first)."""
    fresh = Deployment.objects.select_related("model").filter(pk=dep.pk).first()
    if fresh is None or fresh.state not in DEPLOYMENT_SERVING:
        return False  # already failed (a RUNTIME_FAILED report, a lost node), or never served
    if not deployment_transition(
        deployment_id=ids.deployment_id(fresh.id),
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
    *, dep: Deployment, node_id: NodeId, now: datetime, exclude: tuple[Any, ...] = ()
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
        deployment_id=ids.deployment_id(dep.id),
        node_id=node_id,
        message=f"replaced by {replacement.id}",
        data={"replacement": str(replacement.id)},
    )
    return replacement


def deployment_member_check(*, deployment_id: DeploymentId, node_id: NodeId) -> Deployment:
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


def deployment_runtime_failed(
    *, deployment_id: DeploymentId, node_id: NodeId, message: str, now: datetime
) -> bool:
    """The primary process died (an RPC peer crashed, or it aborted): FAILED, jobs failed, replaced.

    Only a member of the deployment's plan may say so (ReportRefused otherwise; nothing changes).
    """
    dep = deployment_member_check(deployment_id=deployment_id, node_id=node_id)
    if dep.state not in DEPLOYMENT_SERVING:
        return False  # while LOADING, the placement task owns failures (and re-plans)
    return deployment_failed_replace(dep=dep, node_id=node_id, message=message, now=now)


def deployments_lost_on_restart(*, node_id: NodeId, loaded: list[str], now: datetime) -> list[str]:
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


def deployment_request_of(dep: Deployment) -> dict[str, Any]:
    req = dict(dep.request)
    req["pin_nodes"] = tuple(req["pin_nodes"]) if req.get("pin_nodes") else None
    req["exclude_nodes"] = tuple(req.get("exclude_nodes") or ())
    req["pin_devices"] = tuple(req["pin_devices"]) if req.get("pin_devices") else None
    return req


def ensure_lock_key(model_id: ModelId) -> str:
    return f"racon:lock:ensure:{model_id}"


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
    with redis_lock(ensure_lock_key(ids.model_id(model.id)), timeout=30):
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
                dep=draining, node_id=NodeId(_draining_member(draining)), now=now
            )
            if replacement is not None:
                return replacement
        return deployment_create(
            model=model, request=placement_request_from({"engine": "auto"}), now=now, auto=True
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


def drain_replacement_locked(
    *, dep: Deployment, node_id: NodeId, now: datetime
) -> Deployment | None:
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
                deployment_id=ids.deployment_id(dep.id),
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
