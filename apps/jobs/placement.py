"""Placement and loading of a deployment: deployment_place (task racon.jobs.place_deployment).

The plan is chosen and recorded under the placement lock, then loaded: the plan's RPC workers
started, the model file on the primary (a claimed copy challenged, else copied there), the primary
loaded and every member confirmed; READY, or FAILED with the reason. A node lost before execution
is excluded and the plan revised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.models_repo.models import Replica
from apps.models_repo.services import replicas_sync
from apps.nodes.commands import command_send, command_wait
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory, Node
from apps.nodes.states import LOADABLE
from racon import ids, tls
from racon.ids import DeploymentId, NodeId
from racon.locks import redis_lock
from racon.logging import log_context

from . import selectors
from .deployments import deployment_preview, deployment_request_of, deployment_transition
from .jobs import DeploymentError, drains_advance
from .models import Deployment
from .scheduler import PlacementRefused, PlacementRequest, Plan
from .states import DEPLOYMENT_SERVING, DeploymentState

# A primary's coded refusal of the plan itself (agent/runtime/primary.py PlanError): the plan is
# wrong for that node, which is not lost; any other failure to load counts the node as lost.
PLAN_REFUSED_CODES = frozenset(
    {"malformed_plan", "model_missing", "sha256_mismatch", "out_of_memory"}
)

log = logging.getLogger("racon.jobs")
D = DeploymentState


PLACEMENT_LOCK_KEY = "racon:lock:placement"


@contextmanager
def _placement_lock() -> Iterator[bool]:
    # Plans are chosen one at a time, across every worker: each sees the memory and the replicas
    # that the plans before it recorded. Two placements choosing at once both saw a free node and
    # both landed there (two READY replicas of one model on one node under `make run`). Held while
    # the plan is chosen and recorded (milliseconds), never while it loads.
    with redis_lock(PLACEMENT_LOCK_KEY, timeout=60) as acquired:
        yield acquired


def deployment_place(
    *,
    deployment_id: DeploymentId,
    clock: Callable[[], datetime] = timezone.now,
    max_revisions: int = 3,
) -> Deployment:
    """Plan, start the RPC workers, load the primary and confirm every member; READY or FAILED.

    A node lost before execution (a step fails on it) is excluded and the plan revised.
    """
    dep = Deployment.objects.select_related("model", "model_file").get(pk=deployment_id)
    if dep.state != D.PLANNING:
        return dep  # a retried task: another run already took it
    request = PlacementRequest(**deployment_request_of(dep))
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
                            deployment_id=ids.deployment_id(dep.id),
                            node_id=NodeId(plan.primary_node_id),
                            message=(
                                f"primary {selectors.node_name(NodeId(plan.primary_node_id))}, "
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
                    deployment_id=ids.deployment_id(dep.id),
                    to=D.FAILED,
                    now=clock(),
                    kind="PLACEMENT_REFUSED",
                    message=exc.reason[:500],
                    data=exc.to_dict(),
                    fields={"error": exc.reason},
                )
                return Deployment.objects.get(pk=dep.id)
            deployment_transition(
                deployment_id=ids.deployment_id(dep.id),
                to=D.LOADING,
                expected=D.PLANNING,
                now=clock(),
            )
            try:
                report = _deployment_load(dep=dep, plan=plan, clock=clock)
            except _NodeLost as lost:
                excluded.append(lost.node_id)
                event_record(
                    kind="NODE_LOST_BEFORE_EXECUTION",
                    category=EventCategory.PLACEMENT,
                    now=clock(),
                    deployment_id=ids.deployment_id(dep.id),
                    node_id=lost.node_id,
                    message=lost.reason,
                )
                if not deployment_transition(
                    deployment_id=ids.deployment_id(dep.id),
                    to=D.PLANNING,
                    expected=D.LOADING,
                    now=clock(),
                    message="re-scoring without the lost node",
                ):
                    return Deployment.objects.get(pk=dep.id)
                continue
            except DeploymentError as exc:
                deployment_transition(
                    deployment_id=ids.deployment_id(dep.id),
                    to=D.FAILED,
                    expected=D.LOADING,
                    now=clock(),
                    kind="DEPLOYMENT_FAILED",
                    message=str(exc)[:500],
                    data={"error": str(exc)[:8000]},  # an engine's log lines past the message's
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
                    deployment_id=ids.deployment_id(dep.id),
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
                    deployment_id=ids.deployment_id(dep.id),
                    to=D.FAILED,
                    expected=D.LOADING,
                    now=clock(),
                    kind="DEPLOYMENT_FAILED",
                    message=f"internal error during placement: {exc}"[:500],
                    fields={"error": str(exc)},
                )
                return Deployment.objects.get(pk=dep.id)
            if deployment_transition(
                deployment_id=ids.deployment_id(dep.id),
                to=D.READY,
                expected=D.LOADING,
                now=clock(),
                kind="DEPLOYMENT_READY",
                message="every member confirmed ready",
                fields={"load_report": report},
            ):
                drains_advance(
                    deployments=Deployment.objects.filter(
                        model_id=dep.model_id, state__in=list(DEPLOYMENT_SERVING)
                    ),
                    now=clock(),
                )
            return Deployment.objects.get(pk=dep.id)
        deployment_transition(
            deployment_id=ids.deployment_id(dep.id),
            to=D.FAILED,
            now=clock(),
            kind="DEPLOYMENT_FAILED",
            message="too many plan revisions",
            fields={"error": "too many plan revisions"},
        )
        return Deployment.objects.get(pk=dep.id)


class _NodeLost(Exception):
    def __init__(self, node_id: NodeId, reason: str) -> None:
        super().__init__(reason)
        self.node_id = node_id
        self.reason = reason


def _ask(
    *, node_id: NodeId, kind: str, payload: dict[str, Any], timeout: float, late: str
) -> dict[str, Any]:
    """Send a command and wait for its result, without the node_id the report carries. No
    answer within ``timeout`` is the node lost: ``late`` says what it did not do in time."""
    cid = command_send(node_id=node_id, kind=kind, payload=payload)
    result = command_wait(command_id=cid, timeout=timeout)
    if result is None:
        raise _NodeLost(node_id, f"{late} within {timeout:.0f}s")
    return {k: v for k, v in result.items() if k != "node_id"}


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
    tunnel_tls = tunnel_certificate(deployment_id=ids.deployment_id(dep.id))
    primary_address = (
        Node.objects.filter(pk=plan.primary_node_id).values_list("address", flat=True).first()
    )
    exposed: dict[str, list[str]] = {}  # each worker's devices, in the order it serves them
    for worker in plan.rpc_workers():
        node_id = worker["node_id"]
        _require_live(node_id)
        grant = {
            "deployment_id": str(dep.id),
            "tunnel_key": tunnel_key,
            "tunnel_tls": tunnel_tls,
            "primary_address": primary_address,
        }
        worker_name = f"RPC worker on {selectors.node_name(node_id)}"
        result = _ask(
            node_id=node_id,
            kind="rpc_start",
            payload=grant,
            timeout=timeout_rpc,
            late=f"{worker_name} did not confirm",
        )
        if not result.get("ok"):
            raise _NodeLost(node_id, f"{worker_name} failed: {result.get('error', '')}")
        served = (result.get("rpc_worker") or {}).get("devices") or []
        if served and all(isinstance(d, dict) and d.get("name") for d in served):
            exposed[node_id] = [str(d["name"]) for d in served]
        event_record(
            kind="RPC_WORKER_CONFIRMED",
            category=EventCategory.RUNTIME,
            now=clock(),
            node_id=node_id,
            deployment_id=ids.deployment_id(dep.id),
            message=f"RPC worker ready at {worker['endpoint']}",
            data={"endpoint": worker["endpoint"], "result": result},
        )
    # 2. the model file on the primary (only the primary needs it: workers get tensors over RPC).
    # A vLLM plan's model directory is not copied: the node finds it in its models directory by
    # its manifest's sha256 (the load refuses with model_missing where it has none).
    primary = plan.primary_node_id
    _require_live(NodeId(primary))
    vllm = dep.engine == "vllm"
    path = (
        dep.model_file.file_name
        if vllm
        else _ensure_model_file(dep=dep, node_id=NodeId(primary), clock=clock)
    )
    # 3. the primary verifies sha256 and loads with the plan's split
    payload = {
        "deployment_id": str(dep.id),
        "model_name": dep.model.name,
        "model_path": path,
        "sha256": dep.model_file.sha256,
        "rpc_endpoints": list(plan.rpc_endpoints),
        "tensor_split": list(plan.tensor_split),
        # Exactly the plan's devices, in split order, by llama.cpp name: llama-server's --device.
        "offload_devices": _offload_devices(plan, exposed),
        "n_gpu_layers": plan.n_gpu_layers,
        "n_ctx": plan.n_ctx,
        "n_parallel": plan.n_parallel,
        "n_threads": plan.n_threads,
        "n_batch": plan.n_batch,
        "flash_attn": plan.flash_attn,
        "memory_bytes": plan.memory_by_node().get(primary, 0),
        "rpc_tunnel_key": tunnel_key,
        "rpc_tunnel_tls": tunnel_tls,
    }
    if vllm:
        payload.update({"engine": "vllm", "kv_bytes": int(plan.kv_bytes)})
    result = _ask(
        node_id=NodeId(primary),
        kind="load_primary",
        payload=payload,
        timeout=max(timeout_load, settings.VLLM_LOAD_TIMEOUT) if vllm else timeout_load,
        late=f"primary {selectors.node_name(NodeId(primary))} did not load",
    )
    if not result.get("ok"):
        error = str(result.get("error", "load failed"))
        if result.get("code") in PLAN_REFUSED_CODES:
            raise DeploymentError(f"primary refused the plan: {error}")
        if result.get("code") == "engine_failed":
            # The engine itself died at its start or probe (vLLM): the node is fine, the same
            # load elsewhere would die the same way. FAILED, with the engine's last lines.
            tail = [str(line) for line in result.get("log_tail") or []][-8:]
            raise DeploymentError(
                f"{error}" + ("\nengine log:\n" + "\n".join(tail) if tail else "")
            )
        raise _NodeLost(
            NodeId(primary),
            f"primary {selectors.node_name(NodeId(primary))} failed to load: {error}",
        )
    event_record(
        kind="PRIMARY_LOADED",
        category=EventCategory.RUNTIME,
        now=clock(),
        node_id=NodeId(primary),
        deployment_id=ids.deployment_id(dep.id),
        message=f"{dep.model.name} loaded",
        data=result,
    )
    # 4. every member confirmed ready (cheap re-check of their states right before READY)
    for node_id in plan.node_ids:
        _require_live(NodeId(node_id))
    return result


def tunnel_certificate(*, deployment_id: DeploymentId) -> dict[str, str]:
    """A deployment's RPC-tunnel certificate (server and client use) from the controller's CA,
    with its key and the CA certificate, in PEM: sent in the plan's rpc_start and load_primary,
    never stored (agent/tunnel.py pins both ends to exactly this certificate)."""
    ca, _ = tls.ca_load_or_create(var_dir=settings.VAR_DIR)
    leaf = tls.issue_leaf(ca, common_name=f"racon-tunnel {deployment_id}", server=True, client=True)
    return {"cert": leaf.cert_pem.decode(), "key": leaf.key_pem.decode(), "ca": ca.pem().decode()}


def _require_live(node_id: NodeId) -> None:
    state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
    if state not in LOADABLE:
        raise _NodeLost(node_id, f"node {selectors.node_name(node_id)} is {state or 'gone'}")


def _ensure_model_file(*, dep: Deployment, node_id: NodeId, clock: Callable[[], datetime]) -> str:
    """The primary's path to the file; copies it there first when it lacks it (retried once)."""
    replica = Replica.objects.filter(node_id=node_id, model_file=dep.model_file).first()
    if replica is not None:
        # A node's "I hold this file" is a claim: trusted only once its bytes answer a challenge.
        if replica_challenge(
            node_id=node_id,
            model_file=dep.model_file,
            path=replica.path,
            deployment_id=ids.deployment_id(dep.id),
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
            deployment_id=ids.deployment_id(dep.id),
            message=f"copying {mf.file_name} to the primary (attempt {attempt})",
            data={"size": mf.size},
        )
        result = _ask(
            node_id=node_id,
            kind="fetch_model",
            payload={"sha256": mf.sha256, "file_name": mf.file_name, "size": mf.size, "url": url},
            timeout=timeout,
            late="the model transfer did not finish",
        )
        if result.get("ok") and result.get("path"):
            if not replica_challenge(
                node_id=node_id,
                model_file=mf,
                path=str(result["path"]),
                deployment_id=ids.deployment_id(dep.id),
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
                deployment_id=ids.deployment_id(dep.id),
                message=f"{mf.file_name} verified on the primary",
            )
            return str(result["path"])
        last_error = str(result.get("error", "transfer failed"))
    raise DeploymentError(f"model transfer failed twice; file not used: {last_error}")


REPLICA_CHALLENGE_BYTES = 1 << 20


def replica_challenge(
    *,
    node_id: NodeId,
    model_file: Any,
    path: str,
    deployment_id: DeploymentId | None = None,
    now: datetime,
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


def _offload_devices(plan: Plan, exposed: dict[str, list[str]]) -> list[str]:
    try:
        return plan.offload_device_names(exposed)
    except ValueError as exc:  # a worker that no longer serves a device the plan counted on
        raise DeploymentError(str(exc)) from None
