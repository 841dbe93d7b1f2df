"""Cluster shapes for the scheduler's device tests (tests/jobs/test_scheduler_devices.py,
test_scheduler_primary.py): devices named as llama.cpp names them, nodes that may or may not be
the primary."""

from __future__ import annotations

from apps.jobs.scheduler import DeviceSnapshot, NodeSnapshot
from apps.models_repo.profile import synthetic_profile
from racon.ids import NodeId

GiB = 1 << 30

TINY = synthetic_profile(
    name="tiny", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
    tied_embeddings=True,
)  # fmt: skip
LLAMA_8B = synthetic_profile(
    name="llama-8b", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256
)


def cpu(node: str, gib: float, gflops: float = 100.0, bw: float = 20.0) -> DeviceSnapshot:
    return DeviceSnapshot(NodeId(node), "CPU", "cpu", int(gib * GiB), gflops, bw)


def gpu(node: str, name: str, gib: float, gflops: float, bw: float) -> DeviceSnapshot:
    return DeviceSnapshot(NodeId(node), name, "gpu", int(gib * GiB), gflops, bw)


def node(nid: str, *devices: DeviceSnapshot, may_be_primary: bool = True) -> NodeSnapshot:
    return NodeSnapshot(
        node_id=NodeId(nid),
        name=f"host-{nid}",
        state="READY",
        address=f"10.0.0.{ord(nid[0]) % 200}",
        rpc_port=50052,
        devices=devices,
        threads=4,
        may_be_primary=may_be_primary,
    )
