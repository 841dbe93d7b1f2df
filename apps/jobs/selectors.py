"""Reads for deployments and jobs, and the cluster snapshot the scheduler plans on."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db.models import QuerySet

from agent.protocol import heartbeat_key
from apps.models_repo.models import ModelFile, Replica
from apps.nodes.models import Node
from apps.nodes.states import NodeState
from racon.redis import get_redis

from .models import Deployment, Job
from .scheduler import ClusterSnapshot, DeviceSnapshot, Link, NodeSnapshot
from .states import DEPLOYMENT_ACTIVE, DeploymentState

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


def rpc_workers_in_use() -> set[str]:
    """Nodes whose ggml-rpc worker serves an active deployment: a worker takes one primary at a time."""
    busy: set[str] = set()
    for plan in Deployment.objects.filter(state__in=list(DEPLOYMENT_ACTIVE)).exclude(plan={}).values_list("plan", flat=True):
        for d in (plan or {}).get("devices", []):
            if d.get("endpoint"):
                busy.add(d["node_id"])
    return busy


def cluster_snapshot(*, model_file: ModelFile | None = None) -> ClusterSnapshot:
    """Nodes the scheduler may consider, their free memory net of other deployments, and links."""
    busy = rpc_workers_in_use()
    nodes = [
        n
        for n in Node.objects.filter(revoked_at__isnull=True).exclude(state__in=[NodeState.UNINITIALIZED, NodeState.REGISTERING])
        if str(n.id) not in busy
    ]
    reserved = reserved_memory_by_node()
    holders: set[str] = set()
    if model_file is not None:
        holders = {str(n) for n in Replica.objects.filter(model_file=model_file).values_list("node_id", flat=True)}
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
        devices = [DeviceSnapshot(node_id=nid, device="CPU", kind="cpu", free_bytes=ram_free, gflops=gflops, mem_bandwidth_gbps=bw)]
        for gpu in (n.hardware or {}).get("gpus") or []:
            devices.append(
                DeviceSnapshot(
                    node_id=nid, device=f"GPU{gpu.get('index', 0)}", kind="gpu", free_bytes=int(gpu.get("vram_free") or 0),
                    gflops=float(gpu.get("gflops") or gflops * 20), mem_bandwidth_gbps=float(gpu.get("mem_bandwidth_gbps") or 300.0),
                )
            )
        snaps.append(
            NodeSnapshot(
                node_id=nid, name=n.name, state=n.state, address=n.address, rpc_port=n.rpc_port, devices=tuple(devices),
                threads=max(1, n.cpu_physical_cores or n.cpu_logical_cores or 1), has_model_file=nid in holders,
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


def deployment_route(*, model_id: Any) -> Deployment | None:
    """The READY deployment of this model with the least work in flight (DEGRADED only as fallback)."""
    candidates = list(
        Deployment.objects.filter(model_id=model_id, state__in=[DeploymentState.READY, DeploymentState.DEGRADED]).only(
            "id", "state", "primary_id", "plan", "n_ctx", "n_parallel", "model_id"
        )
    )
    if not candidates:
        return None
    r = get_redis()
    loads = r.mget([f"racon:dep:{d.id}:inflight" for d in candidates])
    ranked = sorted(
        zip(candidates, loads, strict=True),
        key=lambda pair: (pair[0].state != DeploymentState.READY, int(pair[1] or 0)),
    )
    return ranked[0][0]


def deployment_list(*, state: str | None = None, model: str | None = None) -> QuerySet[Deployment]:
    qs = Deployment.objects.select_related("model", "primary").all()
    if state:
        qs = qs.filter(state=state)
    if model:
        qs = qs.filter(model__name=model)
    return qs


def job_list(
    *, state: str | None = None, model: str | None = None, node_id: Any = None, since: datetime | None = None,
    until: datetime | None = None, account_id: Any = None,
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

