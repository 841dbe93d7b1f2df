"""Cluster shapes for the pure scheduler's tests: model profiles, devices, nodes, a snapshot, and
the invariants every plan must hold (check_plan)."""

from __future__ import annotations

import json

from apps.jobs.scheduler import (
    ClusterSnapshot,
    DeviceSnapshot,
    Link,
    NodeSnapshot,
    Plan,
    llama_layer_assignment,
)
from apps.models_repo.profile import ModelProfile, synthetic_profile
from racon.ids import NodeId

GiB = 1 << 30

# An 8B llama at Q4_K_M: ~4.6 GiB of weights, so it fits a 16 GiB CPU but no 4 GiB GPU.
LLAMA_8B = synthetic_profile(
    name="llama-8b", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256
)
# A 70B llama at Q4_K_M: ~40 GiB, always a split on small machines.
LLAMA_70B = synthetic_profile(
    name="llama-70b", n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672, n_vocab=128256
)
TINY = synthetic_profile(
    name="tiny",
    n_layer=30,
    n_embd=576,
    n_head=9,
    n_head_kv=3,
    n_ff=1536,
    n_vocab=49152,
    tied_embeddings=True,
)


def cpu(node_id: str, free_gib: float, gflops: float = 200.0, bw: float = 30.0) -> DeviceSnapshot:
    return DeviceSnapshot(NodeId(node_id), "CPU", "cpu", int(free_gib * GiB), gflops, bw)


def gpu(
    node_id: str, index: int, free_gib: float, gflops: float = 30_000.0, bw: float = 600.0
) -> DeviceSnapshot:
    return DeviceSnapshot(NodeId(node_id), f"GPU{index}", "gpu", int(free_gib * GiB), gflops, bw)


def node(
    node_id: str,
    *devices: DeviceSnapshot,
    state: str = "READY",
    has_model_file: bool = False,
    address: str | None = None,
) -> NodeSnapshot:
    return NodeSnapshot(
        node_id=NodeId(node_id),
        name=node_id,
        state=state,
        address=address or f"10.0.0.{abs(hash(node_id)) % 200 + 1}",
        rpc_port=50052,
        devices=devices,
        threads=8,
        has_model_file=has_model_file,
    )


def cluster(
    *nodes: NodeSnapshot, links: dict[tuple[str, str], Link] | None = None
) -> ClusterSnapshot:
    return ClusterSnapshot(nodes=tuple(nodes), links=links or {})


def check_plan(plan: Plan, profile: ModelProfile, snap: ClusterSnapshot) -> None:
    """Invariants every plan must hold: memory, coverage, llama.cpp mapping, eligibility."""
    free = {(d.node_id, d.device): d.free_bytes for n in snap.nodes for d in n.devices}
    states = {n.node_id: n.state for n in snap.nodes}
    for d in plan.devices:
        assert d.memory_bytes <= free[(d.node_id, d.device)], f"{d} exceeds free memory"
        assert d.memory_bytes > 0
        assert states[d.node_id] in ("READY", "DEGRADED")
    # Every layer exactly once, in order, starting at 0.
    cursor = 0
    for d in plan.devices:
        assert d.layer_start == cursor
        assert d.layer_end >= d.layer_start
        cursor = d.layer_end
    assert cursor == profile.n_layer
    # The primary's CPU comes first and is local; remote devices carry their endpoint.
    first = plan.devices[0]
    assert (first.node_id, first.kind, first.endpoint) == (plan.primary_node_id, "cpu", None)
    for d in plan.devices[1:]:
        assert (d.endpoint is None) == (d.node_id == plan.primary_node_id)
    # Remote devices precede the primary's own GPUs (llama.cpp puts RPC devices first), and one
    # node's devices are contiguous so each endpoint is registered once.
    kinds = ["remote" if d.endpoint else "local" for d in plan.devices[1:]]
    assert kinds == sorted(kinds, key=lambda k: k == "local")
    nodes_in_order = [d.node_id for d in plan.devices[1:]]
    assert all(
        nodes_in_order.index(n) + nodes_in_order.count(n) - 1
        == len(nodes_in_order) - 1 - nodes_in_order[::-1].index(n)
        for n in set(nodes_in_order)
    )
    # What llama.cpp will do with n_gpu_layers and tensor_split is what the plan says.
    offload = list(plan.devices[1:])
    assert len(plan.tensor_split) == len(offload)
    per_layer, output_dev = llama_layer_assignment(
        profile.n_layer, plan.n_gpu_layers, plan.tensor_split
    )
    for i, d in enumerate(plan.devices):
        for layer in range(d.layer_start, d.layer_end):
            assert per_layer[layer] == i - 1, (
                f"layer {layer} lands on device {per_layer[layer]}, plan says {i - 1}"
            )
    holders = [i - 1 for i, d in enumerate(plan.devices) if d.holds_output]
    assert holders == [output_dev]
    assert plan.predicted_tokens_per_s > 0 and plan.predicted_ttft_ms > 0
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
