"""Reads for deployments and jobs, and the cluster snapshot the scheduler plans on."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from agent.protocol import heartbeat_key
from apps.models_repo.models import ModelFile, Replica
from apps.nodes.lending import LendingView, lending_view
from apps.nodes.links import link_measurements
from apps.nodes.models import Node
from apps.nodes.states import DRAIN_STATES, NodeState
from racon import cache, ids
from racon.ids import AccountId, ModelId, NodeId
from racon.redis import get_redis

from . import admission
from .models import Deployment, Job
from .scheduler import DEFAULT_LINK, ClusterSnapshot, DeviceSnapshot, Link, NodeSnapshot
from .states import DEPLOYMENT_ACTIVE, DEPLOYMENT_SERVING, DeploymentState

GiB = 1024**3
# Measured figures default to a modest laptop until the agent has benchmarked the machine.
DEFAULT_GFLOPS = 20.0
DEFAULT_BANDWIDTH_GBPS = 10.0


def node_name(node_id: NodeId) -> str:
    return _node_name(str(node_id))


@lru_cache(maxsize=4096)
def _node_name(node_id: NodeId) -> str:
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


def nodes_serving_model(*, model_id: ModelId, exclude_deployment: Any = None) -> set[str]:
    """Members (primary or RPC worker) of the model's active deployments: one replica per node."""
    qs = Deployment.objects.filter(model_id=model_id, state__in=list(DEPLOYMENT_ACTIVE))
    if exclude_deployment is not None:
        qs = qs.exclude(pk=exclude_deployment)
    out: set[str] = set()
    for member, primary in qs.values_list("nodes__id", "primary_id"):
        out.update(str(n) for n in (member, primary) if n is not None)
    return out


def cluster_snapshot(
    *,
    model_file: ModelFile | None = None,
    exclude_deployment: Any = None,
    now: datetime | None = None,
) -> ClusterSnapshot:
    """Nodes the scheduler may consider, their free memory net of other deployments, and links.

    exclude_deployment is the deployment being (re)placed: its own earlier plan neither holds
    memory nor counts as a replica of the model. Free RAM and VRAM come from the live heartbeat
    figures when the heartbeat is fresh; links from the measurements that have not expired.
    """
    now = now or timezone.now()
    busy = rpc_workers_in_use(exclude_deployment=exclude_deployment)
    nodes = [
        n
        for n in Node.objects.filter(revoked_at__isnull=True).exclude(
            state__in=[NodeState.UNINITIALIZED, NodeState.REGISTERING]
        )
        if str(n.id) not in busy
    ]
    reserved = reserved_memory_by_node(exclude_deployment=exclude_deployment)
    reserved_dev = reserved_memory_by_device(exclude_deployment=exclude_deployment)
    holders: set[str] = set()
    serving: set[str] = set()
    if model_file is not None:
        holders = {
            str(n)
            for n in Replica.objects.filter(model_file=model_file).values_list("node_id", flat=True)
        }
        serving = nodes_serving_model(
            model_id=ids.model_id(model_file.model_id), exclude_deployment=exclude_deployment
        )
    live_by_node = live_capacity([str(n.id) for n in nodes], now=now)
    snaps = []
    for n in nodes:
        nid = str(n.id)
        live = live_by_node.get(nid)
        ram_free = max(0, n.ram_available - reserved.get(nid, 0))
        if live is not None and live.mem_available is not None:
            if reserved.get(nid, 0) == 0:
                # Nothing of ours is loaded there: the live figure is the free RAM, up or down
                # (never more than the node has; telemetry_clean bounded it too).
                ram_free = min(live.mem_available, n.ram_total or live.mem_available)
            # Otherwise the live figure already counts our resident deployments, and the last
            # state change's figure minus our books is the estimate (a deployment still loading
            # holds memory that no heartbeat shows yet).
        # The agent measures with numpy (matmul, array copy); llama.cpp's quantized decode reaches a
        # fraction of that, measured by bench/scheduler.py part 3 (SCHEDULER_MEASURED_EFFICIENCY).
        lend = lending_view(lending=n.lending, now=now)
        if lend.ram_bytes is not None:
            # The owner's cap is a planning limit: never more than it, net of our own books.
            ram_free = max(0, min(ram_free, lend.ram_bytes - reserved.get(nid, 0)))
        eff = float(settings.SCHEDULER_MEASURED_EFFICIENCY)
        # The engine runs on the physical cores (plan n_threads), or on the owner's thread cap.
        # The compute benchmark (BLAS matmul) ran on every core (never below one thread's rate:
        # agent/hardware/benchmark.py), so a cap below the default lends that share of it. The
        # bandwidth benchmark copies with one thread, so a cap of one thread or more reaches its
        # figure: scaling it by the share too halved a one-thread host's bandwidth, and
        # bench/multihost.py's two-host split measured 1.30x the prediction (0.90x without),
        # tests/cluster (b) once 1.83x.
        default_threads = n.cpu_physical_cores or n.cpu_logical_cores or 1
        threads = max(1, min(default_threads, lend.threads or default_threads))
        share = threads / default_threads
        gflops = n.gflops * eff * share if n.gflops else DEFAULT_GFLOPS * share
        bw = n.mem_bandwidth_gbps * eff if n.mem_bandwidth_gbps else DEFAULT_BANDWIDTH_GBPS
        devices = [
            DeviceSnapshot(
                node_id=NodeId(nid),
                device="CPU",
                kind="cpu",
                free_bytes=ram_free,
                gflops=gflops,
                mem_bandwidth_gbps=bw,
            )
        ]
        gpus = (n.hardware or {}).get("gpus") or []
        unverified = False
        for pos, gpu in enumerate(gpus):
            name = gpu_device_name(gpu, pos)
            unverified = unverified or not gpu_verified(gpu)
            devices.append(
                DeviceSnapshot(
                    node_id=NodeId(nid),
                    device=name,
                    kind="gpu",
                    free_bytes=_gpu_free(
                        gpu,
                        live=live.gpu_free[pos]
                        if live is not None and pos < len(live.gpu_free)
                        else None,
                        reserved=reserved_dev.get((nid, name), 0),
                    ),
                    **_gpu_speed(gpu, cpu_gflops=gflops, cpu_bandwidth=bw),
                )
            )
        devices = _vram_capped(devices, lend=lend, reserved_dev=reserved_dev)
        snaps.append(
            NodeSnapshot(
                node_id=NodeId(nid),
                name=n.name,
                state=n.state,
                address=n.address,
                rpc_port=n.rpc_port,
                devices=tuple(devices),
                threads=threads,
                has_model_file=nid in holders,
                serves_model=nid in serving,
                window_open=lend.open,
                window_closes_in=lend.closes_in,
                may_be_primary=not unverified,
                engines=tuple(e for e in ((n.hardware or {}).get("engines") or ["llamacpp"]) if e),
            )
        )
    return ClusterSnapshot(
        nodes=tuple(snaps),
        links=link_table(now=now),
        min_window_seconds=float(settings.LENDING_MIN_WINDOW_SECONDS),
    )


def _vram_capped(
    devices: list[DeviceSnapshot], *, lend: LendingView, reserved_dev: dict[tuple[str, str], int]
) -> list[DeviceSnapshot]:
    """The owner's VRAM cap (all GPUs together) as a planning limit: GPUs in order take what
    is left of it after our own deployments' VRAM."""
    if lend.vram_bytes is None:
        return devices
    gpus = [d for d in devices if d.kind == "gpu"]
    left = lend.vram_bytes - sum(reserved_dev.get((d.node_id, d.device), 0) for d in gpus)
    out = []
    for d in devices:
        if d.kind == "gpu":
            free = max(0, min(d.free_bytes, left))
            left -= free
            d = dataclasses.replace(d, free_bytes=free)
        out.append(d)
    return out


def gpu_device_name(gpu: dict[str, Any], pos: int) -> str:
    """A GPU's name in plans: llama.cpp's (CUDA0, Vulkan0) as the agent read it from ggml; an
    older agent's inventory has none, and its GPU is GPU<index>."""
    return str(gpu.get("device") or f"GPU{gpu.get('index', pos)}")


def gpu_verified(gpu: dict[str, Any]) -> bool:
    """Whether a GPU challenge confirmed this GPU's speed claim (apps/jobs/challenges.py writes
    verified_gflops into the inventory entry; a new inventory is a new, unverified claim)."""
    return float(gpu.get("verified_gflops") or 0) > 0


# An unverified GPU is planned at most at this share of its own node's CPU figures: its memory is
# still lent (a plan short of RAM uses it), but a claim alone never outbids a measured CPU, so a
# fake "900 TFLOPS" GPU takes layers only when nothing else holds them, and is never the primary.
GPU_UNVERIFIED_CPU_SHARE = 0.5


def _gpu_speed(gpu: dict[str, Any], *, cpu_gflops: float, cpu_bandwidth: float) -> dict[str, float]:
    """The GPU's figures: as measured by the agent's benchmark (bounded at enrollment,
    hardware_bounds_errors) once a challenge verified them; else the floor, never above the claim."""
    claimed_gflops = float(gpu.get("gflops") or 0) or math.inf
    claimed_bw = float(gpu.get("mem_bandwidth_gbps") or 0) or math.inf
    if gpu_verified(gpu):
        return {
            "gflops": min(claimed_gflops, float(gpu["verified_gflops"])),
            "mem_bandwidth_gbps": claimed_bw if claimed_bw != math.inf else cpu_bandwidth,
        }
    return {
        "gflops": min(claimed_gflops, cpu_gflops * GPU_UNVERIFIED_CPU_SHARE),
        "mem_bandwidth_gbps": min(claimed_bw, cpu_bandwidth * GPU_UNVERIFIED_CPU_SHARE),
    }


def _gpu_free(gpu: dict[str, Any], *, live: int | None, reserved: int) -> int:
    """One GPU's free VRAM: the live figure when there is one (never more than the card has),
    else the inventory's; with a deployment of ours on it, never more than the card less what
    our books hold there."""
    total = int(gpu.get("vram_total") or 0)
    free = int(gpu.get("vram_free") or 0) if live is None else live
    if total:
        free = min(free, total)
        if reserved:
            free = min(free, total - reserved)
    return max(0, free)


@dataclass(frozen=True)
class LiveCapacity:
    """What a node's last heartbeat said is free (None / empty: it did not say)."""

    mem_available: int | None
    gpu_free: tuple[int, ...]


def live_capacity(node_ids: list[str], *, now: datetime) -> dict[str, LiveCapacity]:
    """Free RAM and per-GPU VRAM from each node's heartbeat (one Redis round trip), for those
    whose heartbeat is fresh (within the offline threshold). Bounded by telemetry_clean."""
    if not node_ids:
        return {}
    r = get_redis()
    with r.pipeline(transaction=False) as pipe:
        for nid in node_ids:
            pipe.hmget(heartbeat_key(nid), "at", "mem_available", "gpu_free")
        rows = pipe.execute()
    max_age = float(settings.HEARTBEAT_INTERVAL) * float(settings.HEARTBEAT_OFFLINE_AFTER)
    out: dict[str, LiveCapacity] = {}
    for nid, (at, mem, gpu_free) in zip(node_ids, rows, strict=True):
        try:
            if at is None or now.timestamp() - float(at) > max_age:
                continue
            mem_v = int(mem) if mem not in (None, "") else 0
            frees = tuple(int(x) for x in str(gpu_free or "").split(",") if x != "")
        except ValueError:
            continue
        # 0 is what a heartbeat without the figure stores: unknown, not "no memory".
        out[nid] = LiveCapacity(mem_available=mem_v if mem_v > 0 else None, gpu_free=frees)
    return out


def reserved_memory_by_device(*, exclude_deployment: Any = None) -> dict[tuple[str, str], int]:
    """Memory active deployments hold on each (node, device) of their plans."""
    out: dict[tuple[str, str], int] = {}
    qs = Deployment.objects.filter(state__in=list(DEPLOYMENT_ACTIVE)).exclude(plan={})
    if exclude_deployment is not None:
        qs = qs.exclude(pk=exclude_deployment)
    for plan in qs.values_list("plan", flat=True):
        for d in (plan or {}).get("devices", []):
            key = (d["node_id"], str(d.get("device") or "CPU"))
            out[key] = out.get(key, 0) + int(d.get("memory_bytes") or 0)
    return out


def link_table(*, now: datetime) -> dict[tuple[str, str], Link]:
    """The links agents measured that have not expired, as the scheduler's link map.

    Bandwidth is the timed bulk transfer's; a NIC's nominal speed (an older peer without the
    tunnel's probe mode) is only an upper bound, so the default link's bandwidth caps it. Pairs
    missing here (never measured, or expired) get the scheduler's conservative default.
    """
    out: dict[tuple[str, str], Link] = {}
    for m in link_measurements(now=now):
        bw = m.bandwidth_mbps
        if not m.bandwidth_measured or bw <= 0:
            bw = min(bw, DEFAULT_LINK.bandwidth_mbps) if bw > 0 else DEFAULT_LINK.bandwidth_mbps
        rtt = m.rtt_ms if m.rtt_ms > 0 else DEFAULT_LINK.rtt_ms
        out[(m.source, m.target)] = Link(rtt_ms=rtt, bandwidth_mbps=bw)
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


def deployment_route_candidates(*, model_id: ModelId, cached: bool = False) -> list[Deployment]:
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
    *, model_id: ModelId, cached: bool = False, exclude: Iterable[Any] = ()
) -> Deployment | None:
    """The READY deployment of this model with the largest share of its slots free (DEGRADED
    only as fallback), then the most free slots.

    Free slots are n_parallel minus live slot leases (admission). Ranking by the free share, not
    the free count, spreads load over replicas of different sizes in proportion to their slots
    (a 16-slot replica next to an 8-slot one takes two requests in three instead of all of them
    until it is half full); ties are broken at random so equal replicas share the load.
    ``cached`` reads the candidates from the process cache (the /v1 hot path); slot counts are
    always live. A deployment marked dead (a runtime failure or a lost primary,
    admission.deployment_mark_dead) is skipped at once, whatever the cache says; ``exclude`` skips
    more (a failover's own failed deployment).
    """
    return deployment_rank(
        deployment_route_serving(model_id=model_id, cached=cached, exclude=exclude)
    )


def deployment_route_serving(
    *, model_id: ModelId, cached: bool = False, exclude: Iterable[Any] = ()
) -> list[Deployment]:
    """The route candidates less the ones marked dead and ``exclude`` (deployment_route's set;
    the KV cache coordinator scores these, apps/jobs/kvcache.py)."""
    skip = {str(d) for d in exclude}
    candidates = [
        d
        for d in deployment_route_candidates(model_id=model_id, cached=cached)
        if str(d.id) not in skip
    ]
    if candidates:
        dead = admission.deployments_dead(d.id for d in candidates)
        candidates = [d for d in candidates if str(d.id) not in dead]
    return candidates


def deployment_rank(
    candidates: list[Deployment], *, used: dict[str, int] | None = None
) -> Deployment | None:
    """deployment_route's pick among ``candidates``: READY first, the largest free share, then
    the most free slots, ties at random. ``used``: the candidates' live slot leases, when the
    caller has read them already (kvcache.route_request)."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    if used is None:
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
    node_id: NodeId | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    account_id: AccountId | None = None,
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
            queue_wait_seconds=round(admission.model_queue_wait(ModelId(model_id), now=now), 3),
        )
    return in_use, waiting, out
