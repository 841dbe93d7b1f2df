"""The scheduler's inputs: the cluster snapshot (nodes, devices, links) and the request."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from racon.ids import NodeId

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class DeviceSnapshot:
    """One memory pool a node can give to a model: its CPU (system RAM) or one GPU."""

    node_id: NodeId
    device: str  # "CPU", or llama.cpp's GPU name: "CUDA0", "Vulkan0", "ROCm0", "Metal"
    kind: str  # "cpu" | "gpu"
    free_bytes: int
    gflops: float  # measured compute rate
    mem_bandwidth_gbps: float  # measured memory bandwidth, GB/s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeSnapshot:
    """A node as the scheduler sees it at decision time."""

    node_id: NodeId
    name: str
    state: str
    address: str
    rpc_port: int
    devices: tuple[DeviceSnapshot, ...]
    threads: int = 1
    has_model_file: bool = False
    # A member of an active deployment of the model being placed: one replica per node unless
    # the request says allow_same_node.
    serves_model: bool = False
    # The owner's lending window (apps/nodes/lending.py): closed → never planned; closing within
    # ClusterSnapshot.min_window_seconds → only a fallback (long-lived deployments avoid it).
    window_open: bool = True
    window_closes_in: float | None = None
    # False while the node holds a GPU claim no challenge has verified: it may lend memory, at
    # the floor figures, but never becomes the primary (which reads every prompt) unless the
    # operator pinned its devices.
    may_be_primary: bool = True
    # The engines the node runs (its inventory, issue 30): "llamacpp", and "vllm" where its engine
    # venv is installed and RACON_ENGINES names it.
    engines: tuple[str, ...] = ("llamacpp",)

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.rpc_port}"

    @property
    def free_bytes(self) -> int:
        return sum(d.free_bytes for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = [dev.to_dict() for dev in self.devices]
        return d


@dataclass(frozen=True)
class Link:
    """Measured (or assumed) link between two nodes."""

    rtt_ms: float
    bandwidth_mbps: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Conservative until agents have probed the pair: a slow office LAN.
DEFAULT_LINK = Link(rtt_ms=2.0, bandwidth_mbps=100.0)
# Same node: no network. PCIe copies are small next to everything else we count.
LOCAL_LINK = Link(rtt_ms=0.0, bandwidth_mbps=math.inf)


@dataclass(frozen=True)
class ClusterSnapshot:
    """Nodes plus probed links; pairs never probed use default_link."""

    nodes: tuple[NodeSnapshot, ...]
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    default_link: Link = DEFAULT_LINK
    # A node whose lending window closes sooner than this is avoided (LENDING_MIN_WINDOW_SECONDS).
    min_window_seconds: float = 0.0

    def link(self, a: str, b: str) -> Link:
        """The link between two nodes, either direction; same node is free."""
        if a == b:
            return LOCAL_LINK
        found = self.links.get((a, b)) or self.links.get((b, a))
        return found if found is not None else self.default_link

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [n.to_dict() for n in self.nodes],
            "links": [{"a": a, "b": b, **lk.to_dict()} for (a, b), lk in self.links.items()],
            "default_link": self.default_link.to_dict(),
        }


@dataclass(frozen=True)
class PlacementRequest:
    """What the deployment needs; pins, exclusions and spread constrain where it may go."""

    n_ctx: int = 2048  # each slot's context
    # Slots (llama-server -np). None: as many as memory allows on every device of the plan, up
    # to max_parallel. The dataclass default stays 1 for callers that never asked for slots.
    n_parallel: int | None = 1
    max_parallel: int = 16
    prompt_tokens: int = 128
    pin_nodes: tuple[str, ...] | None = None
    exclude_nodes: tuple[str, ...] = ()
    spread: bool = False  # use every pinned (or eligible) node even when one would do
    memory_margin: float = 0.10  # fraction added on top of each device's computed need
    n_batch: int = 512  # llama.cpp's n_batch/n_ubatch: sizes the compute buffers
    # llama-cpp-python's default is off; on, the attention scores are never materialised and
    # the compute buffers shrink a lot at long contexts. The runtime must pass the plan's value.
    flash_attn: bool = False
    # Place on nodes that already serve this model (another replica on the same node).
    allow_same_node: bool = False
    # The operator's device pin, by llama.cpp name ("Vulkan0", "CPU") or "node:device" (node id
    # or name): the plan's layers go on exactly these devices (eligibility.pin_devices_apply).
    pin_devices: tuple[str, ...] | None = None
    # The operator's choice of primary (a node id): only it may hold the llama-server; the other
    # nodes of the plan lend RPC workers (eligibility.pin_primary_apply).
    primary: str | None = None
    # The engine (issue 30): "llamacpp" (llama-server, split over ggml-rpc where needed) or
    # "vllm" (one node, a safetensors model directory: scheduler/vllm.py plans it).
    engine: str = "llamacpp"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
