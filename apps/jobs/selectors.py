"""Reads for deployments and jobs, and the cluster snapshot the scheduler plans on."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db.models import Q, QuerySet

from agent.protocol import heartbeat_key
from apps.models_repo.models import ModelFile, Replica
from apps.nodes.models import Node
from apps.nodes.states import DRAIN_STATES, NodeState
from racon import cache
from racon.redis import get_redis

from . import admission
from .models import Deployment, Job
from .scheduler import ClusterSnapshot, DeviceSnapshot, Link, NodeSnapshot
from .states import DEPLOYMENT_ACTIVE, DEPLOYMENT_SERVING, DeploymentState

GiB = 1024**3
# Measured figures default to a modest laptop until the agent has benchmarked the machine.
DEFAULT_GFLOPS = 20.0
DEFAULT_BANDWIDTH_GBPS = 10.0


def node_name(node_id: Any) -> str:
    return _node_name(str(node_id))


@lru_cache(maxsize=4096)
def _node_name(node_id: str) -> str:
    return Node.objects.filter(pk=node_id).values_list("name", flat=True).first() or node_id[:8]


def reserved_memory_by_node(*, exclude_deployment: Any = None) -> dict[str, int]:
    """Memory (weights + KV + buffers) that active deployments hold on each node: the KV coordinator's books."""
    out: dict[str, int] = {}
    qs = Deployment.objects.filter(state__in=list(DEPLOYMENT_ACTIVE)).exclude(plan={})
    if exclude_deployment is not None:
        qs = qs.exclude(pk=exclude_deployment)
    for plan in qs.values_list("plan", flat=True):
        for d in (plan or {}).get("devices", []):
            out[d["node_id"]] = out.get(d["node_id"], 0) + int(d.get("memory_bytes") or 0)
    return out


def rpc_workers_in_use(*, exclude_deployment: Any = None) -> set[str]:
    """Nodes whose ggml-rpc worker serves an active deployment: a worker takes one primary at a time."""
    busy: set[str] = set()
    qs = Deployment.objects.filter(state__in=list(DEPLOYMENT_ACTIVE)).exclude(plan={})
    if exclude_deployment is not None:
        qs = qs.exclude(pk=exclude_deployment)
    for plan in qs.values_list("plan", flat=True):
        for d in (plan or {}).get("devices", []):
            if d.get("endpoint"):
                busy.add(d["node_id"])
    return busy


def nodes_serving_model(*, model_id: Any, exclude_deployment: Any = None) -> set[str]:
    """Members (primary or RPC worker) of the model's active deployments: one replica per node."""
    qs = Deployment.objects.filter(model_id=model_id, state__in=list(DEPLOYMENT_ACTIVE))
    if exclude_deployment is not None:
        qs = qs.exclude(pk=exclude_deployment)
    out: set[str] = set()
    for member, primary in qs.values_list("nodes__id", "primary_id"):
        out.update(str(n) for n in (member, primary) if n is not None)
    return out


def cluster_snapshot(
    *, model_file: ModelFile | None = None, exclude_deployment: Any = None
) -> ClusterSnapshot:
    """Nodes the scheduler may consider, their free memory net of other deployments, and links.

    exclude_deployment is the deployment being (re)placed: its own earlier plan neither holds
    memory nor counts as a replica of the model.
    """
    busy = rpc_workers_in_use(exclude_deployment=exclude_deployment)
    nodes = [
        n
        for n in Node.objects.filter(revoked_at__isnull=True).exclude(
            state__in=[NodeState.UNINITIALIZED, NodeState.REGISTERING]
        )
        if str(n.id) not in busy
    ]
    reserved = reserved_memory_by_node(exclude_deployment=exclude_deployment)
    holders: set[str] = set()
    serving: set[str] = set()
    if model_file is not None:
        holders = {
            str(n)
            for n in Replica.objects.filter(model_file=model_file).values_list("node_id", flat=True)
        }
        serving = nodes_serving_model(
            model_id=model_file.model_id, exclude_deployment=exclude_deployment
        )
    r = get_redis()
    with r.pipeline(transaction=False) as pipe:
        for n in nodes:
            pipe.hget(heartbeat_key(str(n.id)), "mem_available")
        live_mem = pipe.execute()
    snaps = []
    for n, live in zip(nodes, live_mem, strict=True):
        nid = str(n.id)
        # Free RAM as the node reported it at its last state change (before our deployments loaded),
        # minus what our active deployments reserved there. Live telemetry caps it when lower and
        # nothing of ours is loaded (another program took the memory).
        ram_free = max(0, n.ram_available - reserved.get(nid, 0))
        if live is not None and reserved.get(nid, 0) == 0:
            ram_free = min(ram_free, int(live)) if int(live) > 0 else ram_free
        # The agent measures with numpy (matmul, array copy); llama.cpp's quantized decode reaches a
        # fraction of that, measured by bench/scheduler.py part 3 (SCHEDULER_MEASURED_EFFICIENCY).
        eff = float(settings.SCHEDULER_MEASURED_EFFICIENCY)
        gflops = n.gflops * eff if n.gflops else DEFAULT_GFLOPS
        bw = n.mem_bandwidth_gbps * eff if n.mem_bandwidth_gbps else DEFAULT_BANDWIDTH_GBPS
        devices = [
            DeviceSnapshot(
                node_id=nid,
                device="CPU",
                kind="cpu",
                free_bytes=ram_free,
                gflops=gflops,
                mem_bandwidth_gbps=bw,
            )
        ]
        for gpu in (n.hardware or {}).get("gpus") or []:
            devices.append(
                DeviceSnapshot(
                    node_id=nid,
                    device=f"GPU{gpu.get('index', 0)}",
                    kind="gpu",
                    free_bytes=int(gpu.get("vram_free") or 0),
                    gflops=float(gpu.get("gflops") or gflops * 20),
                    mem_bandwidth_gbps=float(gpu.get("mem_bandwidth_gbps") or 300.0),
                )
            )
        snaps.append(
            NodeSnapshot(
                node_id=nid,
                name=n.name,
                state=n.state,
                address=n.address,
                rpc_port=n.rpc_port,
                devices=tuple(devices),
                threads=max(1, n.cpu_physical_cores or n.cpu_logical_cores or 1),
                has_model_file=nid in holders,
                serves_model=nid in serving,
            )
        )
    return ClusterSnapshot(nodes=tuple(snaps), links=link_table())


def link_table() -> dict[tuple[str, str], Link]:
    """Link probes the agents reported (racon:links), as the scheduler's link map."""
    out: dict[tuple[str, str], Link] = {}
    for pair, raw in get_redis().hgetall("racon:links").items():
        a, _, b = pair.partition("|")
        try:
            v = json.loads(raw)
            out[(a, b)] = Link(rtt_ms=float(v["rtt_ms"]), bandwidth_mbps=float(v["bandwidth_mbps"]))
        except (ValueError, KeyError):
            continue
    return out


ROUTE_CACHE = "route"  # racon/cache.py: invalidated by deployment_transition


def deployments_off_drained_nodes(qs: QuerySet[Deployment]) -> QuerySet[Deployment]:
    """Those of ``qs`` with no member (primary or plan node) draining or drained: they take new jobs."""
    return qs.exclude(nodes__state__in=DRAIN_STATES).exclude(primary__state__in=DRAIN_STATES)


def deployments_on_drained_nodes(qs: QuerySet[Deployment]) -> QuerySet[Deployment]:
    """Those of ``qs`` with a member draining or drained: they finish their own jobs, and take none."""
    return qs.filter(
        Q(nodes__state__in=DRAIN_STATES) | Q(primary__state__in=DRAIN_STATES)
    ).distinct()


def deployment_route_candidates(*, model_id: Any, cached: bool = False) -> list[Deployment]:
    """The model's READY and DEGRADED deployments with no draining member (from the process
    cache with ``cached``: a node starting or ending a drain clears it, receivers.py)."""

    def load() -> list[Deployment]:
        return list(
            deployments_off_drained_nodes(
                Deployment.objects.filter(model_id=model_id, state__in=DEPLOYMENT_SERVING)
            ).only("id", "state", "primary_id", "plan", "n_ctx", "n_parallel", "model_id")
        )

    return cache.cached(ROUTE_CACHE, str(model_id), load) if cached else load()


def deployment_route(
    *, model_id: Any, cached: bool = False, exclude: Iterable[Any] = ()
) -> Deployment | None:
    """The READY deployment of this model with the largest share of its slots free (DEGRADED
    only as fallback), then the most free slots.

    Free slots are n_parallel minus live slot leases (admission). Ranking by the free share, not
    the free count, spreads load over replicas of different sizes in proportion to their slots
    (a 16-slot replica next to an 8-slot one takes two requests in three instead of all of them
    until it is half full); ties are broken at random so equal replicas share the load. ``cached`` reads the candidates from the process cache (the
    /v1 hot path); slot counts are always live. A deployment marked dead (a runtime failure or a
    lost primary, admission.deployment_mark_dead) is skipped at once, whatever the cache says;
    ``exclude`` skips more (a failover's own failed deployment).
    """
    skip = {str(d) for d in exclude}
    candidates = [
        d
        for d in deployment_route_candidates(model_id=model_id, cached=cached)
        if str(d.id) not in skip
    ]
    if candidates:
        dead = admission.deployments_dead(d.id for d in candidates)
        candidates = [d for d in candidates if str(d.id) not in dead]
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    used = admission.slots_in_use([d.id for d in candidates])
    ranked = sorted(
        candidates,
        key=lambda d: (
            d.state != DeploymentState.READY,
            used.get(str(d.id), 0) / max(1, int(d.n_parallel or 1)),
            -(int(d.n_parallel or 1) - used.get(str(d.id), 0)),
            random.random(),
        ),
    )
    return ranked[0]


def deployment_list(*, state: str | None = None, model: str | None = None) -> QuerySet[Deployment]:
    qs = Deployment.objects.select_related("model", "primary").all()
    if state:
        qs = qs.filter(state=state)
    if model:
        qs = qs.filter(model__name=model)
    return qs


def job_list(
    *,
    state: str | None = None,
    model: str | None = None,
    node_id: Any = None,
    since: datetime | None = None,
    until: datetime | None = None,
    account_id: Any = None,
) -> QuerySet[Job]:
    qs = Job.objects.select_related("model", "deployment").all()
    if state:
        qs = qs.filter(state=state)
    if model:
        qs = qs.filter(model__name=model)
    if node_id:
        qs = qs.filter(nodes__id=node_id)
    if since:
        qs = qs.filter(queued_at__gte=since)
    if until:
        qs = qs.filter(queued_at__lt=until)
    if account_id is not None:
        qs = qs.filter(account_id=account_id)
    return qs.distinct()


@dataclass(frozen=True)
class ModelLoad:
    """A model's replicas and queue, as the deployments pages, the CLI and /metrics show them."""

    replicas: int  # active deployments (PLANNING, LOADING, READY, DEGRADED)
    ready: int  # of which READY or DEGRADED (serving)
    slots_in_use: int
    slots: int  # n_parallel summed over the serving replicas
    queue_depth: int
    queue_wait_seconds: float


def replica_load(
    *,
    deployments: Iterable[Deployment] = (),
    model_ids: Iterable[Any] = (),
    now: float | None = None,
) -> tuple[dict[str, int], dict[str, int], dict[str, ModelLoad]]:
    """(slots in use by deployment id, live waiters by deployment id, ModelLoad by model id) for
    the given deployments and models, the models of those deployments included.

    One database query and a fixed number of Redis round trips (admission's readers) plus one per
    model for its queue wait, whatever the number of deployments.
    """
    listed = list(deployments)
    models = {str(m) for m in model_ids} | {str(d.model_id) for d in listed}
    active = list(
        Deployment.objects.filter(
            model_id__in=models, state__in=list(DEPLOYMENT_ACTIVE)
        ).values_list("id", "model_id", "state", "n_parallel")
    )
    dep_ids = list(dict.fromkeys([str(d.id) for d in listed] + [str(a[0]) for a in active]))
    in_use = admission.slots_in_use(dep_ids, now=now)
    waiting = admission.queue_depth(dep_ids, now=now)
    out: dict[str, ModelLoad] = {}
    for model_id in sorted(models):
        mine = [a for a in active if str(a[1]) == model_id]
        serving = [a for a in mine if a[2] in DEPLOYMENT_SERVING]
        out[model_id] = ModelLoad(
            replicas=len(mine),
            ready=len(serving),
            slots_in_use=sum(in_use.get(str(a[0]), 0) for a in mine),
            slots=sum(int(a[3] or 1) for a in serving),
            queue_depth=sum(waiting.get(str(a[0]), 0) for a in mine),
            queue_wait_seconds=round(admission.model_queue_wait(model_id, now=now), 3),
        )
    return in_use, waiting, out


def job_stream_node(job_id: Any) -> str | None:
    """The node whose prefix holds the job's stream: its deployment's primary (None before dispatch)."""
    primary = Job.objects.filter(pk=job_id).values_list("deployment__primary_id", flat=True).first()
    return str(primary) if primary else None
