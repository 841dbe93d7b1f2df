"""Heterogeneous placement: model profile + cluster snapshot + request → plan, or a clear refusal.

Pure module (no Django, no ORM): the controller builds the snapshots from its rows and calls
``plan_placement``. ``exhaustive_best`` and ``memory_proportional_plan`` exist for tests and
``bench/scheduler.py``.

The contract with the agent runtime (llama.cpp + ggml-rpc), checked against llama.cpp's source
(src/llama.cpp device selection, src/llama-model.cpp layer assignment):

- llama.cpp's offload device list is: every RPC device, in endpoint registration order (and,
  within one endpoint, in the order its worker exposes them), **then** the primary's own GPUs.
  RPC servers go to the *front* of the list. The primary's CPU is never in the list: it holds the
  layers that are not offloaded.
- ``n_gpu_layers = g`` offloads layers ``i >= n_layer + 1 - g`` and counts the output layer as
  one of the ``g``; the output sits on the last offload device. So with ``k`` layers on the
  primary's CPU, ``g = n_layer + 1 - k`` and ``tensor_split`` holds, per offload device, its layer
  count, plus one on the last device for the output. All remote: ``g = n_layer + 1``. Nothing
  offloaded: ``g = 0`` and ``tensor_split = []``. ``llama_layer_assignment`` (agent/layers.py) replays llama.cpp's
  rule so tests can prove a plan lands where it says.
- Hence ``Plan.devices`` is ordered exactly as the layers run: the primary's CPU (always first,
  possibly with no layers, because it always holds the token embeddings and host buffers), then
  the remote nodes' devices grouped per node, then the primary's GPUs. ``tensor_split`` has one
  entry per device after the first, in that order. The runtime must make llama.cpp see the same
  list: each worker exposes exactly its plan devices in plan order, and the primary limits its
  visible GPUs to the plan's (CUDA_VISIBLE_DEVICES in plan order).
- ggml-rpc moves every activation through the primary (a tensor copy between two different
  servers falls back to get + set on the primary), so each remote node costs one round trip to
  the primary per forward pass, whatever the order of the remote nodes.
- ``Plan.flash_attn`` and ``Plan.n_batch`` size the compute buffers counted here; the runtime
  must pass them to llama.cpp (llama-cpp-python defaults to flash_attn=False, n_batch=512).

Checked for real with llama-cpp-python 0.3.36 and two loopback ggml-rpc workers: the SmolLM2
spread plan (28 layers on the primary's CPU, 1 on the first worker, 1 plus the output on the
second; n_gpu_layers=3, tensor_split=[1, 2]) loaded exactly there, and answered "Paris.".
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from agent.layers import (
    llama_layer_assignment as llama_layer_assignment,  # the one copy of llama.cpp's rule, re-exported
)
from apps.models_repo.profile import ModelProfile

GiB = 1 << 30
MiB = 1 << 20

# Node states (apps.nodes.states values). Only READY takes new work; DEGRADED is a fallback when
# nothing else fits; every other state (DRAINING, OFFLINE, ERROR, BUSY, UNINITIALIZED,
# REGISTERING...) is never placed on.
ELIGIBLE_STATES = frozenset({"READY"})
FALLBACK_STATES = frozenset({"DEGRADED"})

# Infeasible candidates still get a cost so the greedy search is pulled towards capacity first.
_UNPLACED_LAYER_PENALTY_S = 1e6


# --- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSnapshot:
    """One memory pool a node can give to a model: its CPU (system RAM) or one GPU."""

    node_id: str
    device: str  # "CPU", "GPU0", "GPU1"...
    kind: str  # "cpu" | "gpu"
    free_bytes: int
    gflops: float  # measured compute rate
    mem_bandwidth_gbps: float  # measured memory bandwidth, GB/s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeSnapshot:
    """A node as the scheduler sees it at decision time."""

    node_id: str
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CostModel:
    """Constants of the latency and memory model; defaults are llama.cpp's and a LAN's."""

    # Fixed cost per remote node per forward pass on top of the RTT: serialising the graph
    # call, socket wake-ups and the worker's thread hand-off (ggml-rpc is one request stream).
    rpc_overhead_ms: float = 0.3
    # A plan within this fraction of the fastest one is preferred when it uses fewer nodes,
    # then when its primary already holds the model file. Predictions are rough (±30% is the
    # target), so a split must predict clearly faster to be worth another node that can fail.
    prefer_fewer_tolerance: float = 0.05
    # ggml's scheduler keeps this many copies of each split's inputs when it pipelines across
    # devices (GGML_SCHED_MAX_COPIES; llama.cpp enables it when every layer is offloaded to more
    # than one device, RPC devices included).
    pipeline_copies: int = 4
    # Fixed part of every compute buffer (graph metadata, small inputs). With the estimate in
    # compute_buffer_bytes this lands 1-30% above what llama.cpp reported for SmolLM2 (CPU and
    # RPC devices, flash attention on and off, n_ctx 2048 and 8192, with and without pipelining).
    compute_buffer_fixed_bytes: int = 4 * MiB
    # Per layer per token dispatch cost on a device (kernel launches, thread barriers).
    layer_overhead_ms: float = 0.01

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_COST = CostModel()


# --- outputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanDevice:
    """One device of a plan, in llama.cpp's layer order; endpoint None means the primary itself."""

    node_id: str
    device: str
    kind: str
    layer_start: int
    layer_end: int  # exclusive
    memory_bytes: int  # weights + KV + compute buffer (+ embeddings/output) + safety margin
    endpoint: str | None
    holds_output: bool = False
    free_bytes: int = 0

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["n_layers"] = self.n_layers
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanDevice:
        """Inverse of to_dict (derived keys ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Plan:
    """Where a model runs, how llama.cpp is told so, and what we predict for it."""

    primary_node_id: str
    devices: tuple[PlanDevice, ...]
    tensor_split: tuple[float, ...]
    n_gpu_layers: int
    n_threads: int
    n_ctx: int
    n_parallel: int
    n_batch: int
    flash_attn: bool
    predicted_ttft_ms: float
    predicted_tokens_per_s: float
    explanation: tuple[str, ...]

    @property
    def node_ids(self) -> tuple[str, ...]:
        """Nodes that hold layers or the model's host side, in plan order, without repeats."""
        seen: dict[str, None] = {}
        for d in self.devices:
            if d.n_layers > 0 or d.endpoint is None:
                seen.setdefault(d.node_id, None)
        return tuple(seen)

    @property
    def layer_devices(self) -> tuple[PlanDevice, ...]:
        return tuple(d for d in self.devices if d.n_layers > 0)

    @property
    def rpc_endpoints(self) -> tuple[str, ...]:
        """Endpoints the primary registers, in order (ggml_backend_rpc_add_server)."""
        seen: dict[str, None] = {}
        for d in self.devices:
            if d.endpoint is not None:
                seen.setdefault(d.endpoint, None)
        return tuple(seen)

    def rpc_workers(self) -> list[dict[str, Any]]:
        """Per remote node: endpoint and the devices its worker must expose, in plan order."""
        out: dict[str, dict[str, Any]] = {}
        for d in self.devices:
            if d.endpoint is None:
                continue
            w = out.setdefault(
                d.node_id, {"node_id": d.node_id, "endpoint": d.endpoint, "devices": []}
            )
            w["devices"].append(d.device)
        return list(out.values())

    def memory_by_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.devices:
            out[d.node_id] = out.get(d.node_id, 0) + d.memory_bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "primary_node_id": self.primary_node_id,
            "devices": [d.to_dict() for d in self.devices],
            "rpc_endpoints": list(self.rpc_endpoints),
            "tensor_split": list(self.tensor_split),
            "n_gpu_layers": self.n_gpu_layers,
            "n_threads": self.n_threads,
            "n_ctx": self.n_ctx,
            "n_parallel": self.n_parallel,
            "n_batch": self.n_batch,
            "flash_attn": self.flash_attn,
            "predicted_ttft_ms": self.predicted_ttft_ms,
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "explanation": list(self.explanation),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of to_dict, for a plan stored as JSON (derived keys ignored)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["devices"] = tuple(PlanDevice.from_dict(d) for d in data["devices"])
        kwargs["tensor_split"] = tuple(float(x) for x in data["tensor_split"])
        kwargs["explanation"] = tuple(data.get("explanation", ()))
        return cls(**kwargs)


class PlacementRefused(Exception):
    """No plan satisfies the request; reason is meant for the operator as is.

    code tells callers the kind apart without reading the words: "no_capacity" (memory or
    nodes), "invalid_request" (bad input) and "n_parallel_too_large" (limit: the slots that fit).
    """

    def __init__(
        self,
        reason: str,
        missing_bytes: int = 0,
        best_set: Sequence[str] = (),
        *,
        code: str = "no_capacity",
        limit: int | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing_bytes = int(missing_bytes)
        self.best_set = tuple(best_set)
        self.code = code
        self.limit = limit

    @property
    def bad_input(self) -> bool:
        """The request itself is wrong (an HTTP 400), not the cluster too small (a 422)."""
        return self.code in ("invalid_request", "n_parallel_too_large")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "reason": self.reason,
            "missing_bytes": self.missing_bytes,
            "best_set": list(self.best_set),
            "refusal": self.code,
        }
        if self.limit is not None:
            d["limit"] = self.limit
        return d


# --- cost model -------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Human size in GiB (or MiB below one GiB), as refusals and explanations print it."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB"


def kv_bytes_per_layer(profile: ModelProfile, request: PlacementRequest) -> int:
    """KV cache of one layer for n_ctx tokens in each of n_parallel slots (None counts as 1)."""
    return profile.kv_bytes_per_token_per_layer * request.n_ctx * (request.n_parallel or 1)


def compute_buffer_bytes(
    profile: ModelProfile,
    request: PlacementRequest,
    *,
    holds_layers: bool,
    holds_output: bool,
    copies: int = 1,
    cost: CostModel = DEFAULT_COST,
) -> int:
    """Estimate of llama.cpp's compute buffer on one device (its worst-case n_batch graph).

    ggml-alloc reuses memory between layers, so the peak is one layer's live tensors for a full
    batch. Pipeline parallelism (copies > 1) duplicates only each split's input tensors
    (ggml_backend_sched marks the copies as inputs/outputs), not the whole buffer.
    """
    nb = max(1, min(request.n_batch, request.n_ctx))
    n_kv = -(-request.n_ctx // 256) * 256  # llama.cpp pads the KV length it reserves for
    n_ff = profile.n_ff or 4 * profile.n_embd
    copies = max(1, copies)
    # Split inputs: the incoming hidden state, the KQ mask, positions and token ids.
    mask_bytes = 2 if request.flash_attn else 4
    inputs = nb * profile.n_embd * 4 + n_kv * nb * mask_bytes + nb * 8
    residual = nb * profile.n_embd * 4
    if not holds_layers and not holds_output:
        # A primary CPU with no layers still embeds the batch and stages every split's inputs.
        return cost.compute_buffer_fixed_bytes + residual + inputs * copies
    peak = 0
    if holds_layers:
        # One layer for the whole batch: FFN gate/up/activation and the residual stream...
        peak = inputs + nb * 4 * (3 * n_ff + 4 * profile.n_embd)
        if request.flash_attn:
            peak += nb * profile.n_head * profile.head_dim * 4 * 2
        else:
            # ...plus, without flash attention, the attention scores over the whole context.
            peak += n_kv * nb * profile.n_head * 4
    if holds_output:
        # n_outputs_max defaults to n_batch: the worst-case graph reserves logits for all of it.
        # ggml-alloc frees the layers' tensors by then, so this is a separate peak, not a sum.
        peak = max(peak, nb * profile.n_vocab * 4 + inputs + residual)
    return cost.compute_buffer_fixed_bytes + peak + inputs * (copies - 1)


def host_buffer_bytes(profile: ModelProfile, request: PlacementRequest) -> int:
    """What the primary's CPU holds whatever the split: embeddings, other tensors, logits."""
    return (
        profile.embedding_bytes
        + profile.other_bytes
        + profile.n_vocab * 4 * max(1, request.n_parallel or 1)  # the output (logits) buffer
    )


def _roofline_s(flops: float, nbytes: float, dev: DeviceSnapshot) -> float:
    compute = flops / (max(dev.gflops, 1e-6) * 1e9)
    memory = nbytes / (max(dev.mem_bandwidth_gbps, 1e-6) * 1e9)
    return max(compute, memory)


def layer_times(
    profile: ModelProfile, request: PlacementRequest, dev: DeviceSnapshot
) -> tuple[float, float]:
    """Seconds for one mean layer on dev: (one decoded token, the whole prompt)."""
    n = max(1, profile.n_layer)
    w_bytes = sum(profile.layer_bytes) / n
    w_flops = 2.0 * sum(profile.layer_params) / n
    ctx = max(1, request.prompt_tokens)
    kv = profile.kv_bytes_per_token_per_layer
    # QK^T and softmax(QK^T)V: 2 matmuls of n_head x head_dim x ctx, 2 FLOPs per MAC.
    attn_flops_per_ctx = 4.0 * profile.n_head * profile.head_dim
    tg = _roofline_s(w_flops + attn_flops_per_ctx * ctx, w_bytes + kv * ctx, dev)
    # Prompt: weights are read once per batch, every token computes; causal attention ~ ctx/2.
    pp = 0.0
    remaining = ctx
    while remaining > 0:
        chunk = min(remaining, request.n_batch)
        done = ctx - remaining
        flops = chunk * (w_flops + attn_flops_per_ctx * (done + chunk / 2))
        pp += _roofline_s(flops, w_bytes + kv * (done + chunk), dev)
        remaining -= chunk
    return tg, pp


def output_time_s(profile: ModelProfile, dev: DeviceSnapshot) -> float:
    """Seconds for the output norm + LM head for one token on dev (prompts output one row)."""
    return _roofline_s(2.0 * profile.output_params, profile.output_bytes, dev)


def hop_s(
    profile: ModelProfile,
    request: PlacementRequest,
    link: Link,
    *,
    holds_output: bool,
    prompt: bool,
    cost: CostModel = DEFAULT_COST,
) -> float:
    """Seconds one remote node adds per forward pass: RTT + overhead + bytes in and out."""
    if link is LOCAL_LINK or link.rtt_ms == 0 and math.isinf(link.bandwidth_mbps):
        return 0.0
    tokens = max(1, request.prompt_tokens) if prompt else 1
    passes = math.ceil(tokens / request.n_batch) if prompt else 1
    bytes_in = tokens * profile.activation_bytes
    # Only the last prompt token produces logits (n_outputs = 1).
    bytes_out = profile.logits_bytes if holds_output else tokens * profile.activation_bytes
    bw = max(link.bandwidth_mbps, 1e-6) * 1e6 / 8
    return passes * (link.rtt_ms + cost.rpc_overhead_ms) / 1000 + (bytes_in + bytes_out) / bw


# --- internal model of a cluster for one decision --------------------------------------------


class _Dev:
    __slots__ = ("snap", "node", "t_tg", "out_tg", "cap", "cap_out", "pcap", "pcap_out", "order")

    def __init__(self, snap: DeviceSnapshot, node: _Node) -> None:
        self.snap = snap
        self.node = node
        self.t_tg = 0.0  # seconds per layer per decoded token
        self.out_tg = 0.0  # seconds for the output layer per token
        self.cap = 0  # layers that fit, without the output
        self.cap_out = 0  # layers that fit next to the output
        self.pcap = 0  # the same two with ggml's pipeline copies of the compute buffer
        self.pcap_out = 0
        self.order = 0  # tie-break so equal devices sort deterministically


class _Node:
    """A node as the search sees it. Ranking figures are computed for every node; the device
    objects only for the nodes the search actually touches (a 1,000-node cluster has ~1,700
    devices, and building all of them dominated the decision time)."""

    __slots__ = (
        "snap",
        "ctx",
        "index",
        "cap_primary",
        "primary_ok",
        "cap_alone",
        "best_t",
        "total_cap",
        "alone_est",
        "_devs",
        "_cpu",
        "_gpus",
        "_best_out",
    )

    def __init__(self, snap: NodeSnapshot, ctx: _Ctx, index: int) -> None:
        self.snap = snap
        self.ctx = ctx
        self.index = index  # position in the cluster: tie-breaks and plan order
        self.cap_primary = -1  # layers on this node's CPU when it is the primary (offloading)
        self.primary_ok = False  # its CPU can host embeddings + host buffers
        self.cap_alone = -1  # layers on its CPU when it runs the whole model there (output too)
        self.best_t = math.inf  # fastest per-layer time among devices with room
        self.total_cap = 0  # layers its devices can hold as a remote node
        self.alone_est = math.inf  # rough latency when it runs the model by itself
        self._devs: list[_Dev] | None = None
        self._cpu: _Dev | None = None
        self._gpus: list[_Dev] = []
        self._best_out: _Dev | None = None

    @property
    def devs(self) -> list[_Dev]:
        """Its devices, fastest first."""
        if self._devs is None:
            self.ctx.materialize(self)
            assert self._devs is not None
        return self._devs

    @property
    def cpu(self) -> _Dev | None:
        if self._devs is None:
            self.ctx.materialize(self)
        return self._cpu

    @property
    def gpus(self) -> list[_Dev]:
        if self._devs is None:
            self.ctx.materialize(self)
        return self._gpus

    @property
    def best_out(self) -> _Dev | None:
        """The device that would best hold the output layer."""
        if self._devs is None:
            self.ctx.materialize(self)
        return self._best_out


def _fit_layers(free: float, fixed: float, per_layer: float, limit: int) -> int:
    room = free - fixed
    if room < 0:
        return -1
    return min(limit, int(room // per_layer)) if per_layer > 0 else limit


class _Ctx:
    """Everything precomputed for one decision; evaluation reuses it thousands of times."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSnapshot,
        request: PlacementRequest,
        nodes: Sequence[NodeSnapshot],
        cost: CostModel,
    ) -> None:
        self.profile = profile
        self.cluster = cluster
        self.request = request
        self.cost = cost
        n_layer = self.n_layer = profile.n_layer
        margin = self.margin = 1.0 + max(0.0, request.memory_margin)
        per_layer = self.per_layer = profile.max_layer_bytes + kv_bytes_per_layer(profile, request)

        def cbuf(layers: bool, output: bool, copies: int = 1) -> int:
            return compute_buffer_bytes(
                profile, request, holds_layers=layers, holds_output=output, copies=copies, cost=cost
            )

        pc = max(1, cost.pipeline_copies)
        cb, cb_out, pcb, pcb_out = (
            cbuf(True, False),
            cbuf(True, True),
            cbuf(True, False, pc),
            cbuf(True, True, pc),
        )
        host = host_buffer_bytes(profile, request)
        # Pipelining copies the primary's staged inputs too; count them whenever it may happen.
        self.host_fixed_idle = host + cbuf(False, False, pc)
        self.host_fixed_layers = host + cb
        # A plain local run: the output on the CPU too, one device so no pipeline copies.
        self.alone_fixed = host + profile.output_bytes + cb_out
        self.out_fixed = profile.output_bytes + cb_out
        # Per-token figures for the roofline, inlined below because this loop runs for every
        # device of a 1,000-node cluster on each decision.
        ctx_len = max(1, request.prompt_tokens)
        w_bytes = sum(profile.layer_bytes) / max(1, n_layer)
        w_flops = 2.0 * sum(profile.layer_params) / max(1, n_layer)
        tg_flops = w_flops + 4.0 * profile.n_head * profile.head_dim * ctx_len
        tg_bytes = w_bytes + profile.kv_bytes_per_token_per_layer * ctx_len
        out_flops = 2.0 * profile.output_params
        out_bytes = float(profile.output_bytes)
        overhead = cost.layer_overhead_ms / 1000
        per_layer = max(per_layer, 1)
        out_fixed = self.out_fixed
        pout_fixed = profile.output_bytes + pcb_out
        self.nodes: list[_Node] = []
        self.by_id: dict[str, _Node] = {}
        self._t = (tg_flops, tg_bytes, out_flops, out_bytes, overhead)
        self._caps = (cb, out_fixed, pcb, pout_fixed)
        host_idle, host_layers, alone_fixed = (
            self.host_fixed_idle,
            self.host_fixed_layers,
            self.alone_fixed,
        )
        # Cheap pass over every device: per-layer time and room, enough to rank nodes. Inlined
        # arithmetic (no helper calls) because it runs for every device on every decision.
        for index, ns in enumerate(nodes):
            node = _Node(ns, self, index)
            ts: list[tuple[float, int]] = []
            cpu_free = -1.0
            cpu_t = math.inf
            for ds in ns.devices:
                gf = (ds.gflops if ds.gflops > 1e-6 else 1e-6) * 1e9
                bw = (ds.mem_bandwidth_gbps if ds.mem_bandwidth_gbps > 1e-6 else 1e-6) * 1e9
                a, b = tg_flops / gf, tg_bytes / bw
                t = (a if a > b else b) + overhead
                free = ds.free_bytes / margin
                c = int((free - cb) // per_layer) if free >= cb else -1
                c = c if c < n_layer else n_layer
                if cpu_free < 0 and ds.kind == "cpu":
                    cpu_free, cpu_t = free, t
                elif c > 0:
                    ts.append((t, c))
                if c > 0:
                    node.total_cap += c
                    if t < node.best_t:
                        node.best_t = t
            if cpu_free >= host_idle:
                node.primary_ok = True
                cp = int((cpu_free - host_layers) // per_layer) if cpu_free >= host_layers else -1
                cp = node.cap_primary = cp if cp < n_layer else n_layer
                ca = int((cpu_free - alone_fixed) // per_layer) if cpu_free >= alone_fixed else -1
                ca = node.cap_alone = ca if ca < n_layer else n_layer
                if ts:
                    node.alone_est = self._alone_estimate(ts, cpu_t, cp, ca)
                elif ca >= n_layer:
                    node.alone_est = n_layer * cpu_t
            elif cpu_free >= 0:
                node.cap_primary = _fit_layers(cpu_free, host_layers, per_layer, n_layer)
                node.cap_alone = _fit_layers(cpu_free, alone_fixed, per_layer, n_layer)
            self.nodes.append(node)
            self.by_id[ns.node_id] = node
        self._hop_cache: dict[tuple[int, int, bool], float] = {}
        self._ranking: list[_Node] | None = None
        self._default_hops = (
            hop_s(
                profile, request, cluster.default_link, holds_output=False, prompt=False, cost=cost
            ),
            hop_s(
                profile, request, cluster.default_link, holds_output=True, prompt=False, cost=cost
            ),
        )

    def _alone_estimate(
        self, gpus: list[tuple[float, int]], cpu_t: float, cap_primary: int, cap_alone: int
    ) -> float:
        """Rough decode latency of a node running the model by itself (inf when it cannot):
        its GPUs fastest first, the rest on its CPU. Only ranks primaries; never a prediction."""
        n_layer = self.n_layer
        best = n_layer * cpu_t if cap_alone >= n_layer else math.inf
        if gpus:
            need, total = n_layer, 0.0
            for t, c in sorted([*gpus, (cpu_t, max(0, cap_primary))]):
                take = c if c < need else need
                total += take * t
                need -= take
                if need == 0:
                    return min(best, total)
        return best

    def materialize(self, node: _Node) -> None:
        """Build a node's device objects (times, every cap variant, output candidate)."""
        tg_flops, tg_bytes, out_flops, out_bytes, overhead = self._t
        cb, out_fixed, pcb, pout_fixed = self._caps
        n_layer, per_layer, margin = self.n_layer, self.per_layer, self.margin
        devs: list[_Dev] = []
        for i, ds in enumerate(node.snap.devices):
            d = _Dev(ds, node)
            d.order = node.index * 64 + i
            gf = (ds.gflops if ds.gflops > 1e-6 else 1e-6) * 1e9
            bw = (ds.mem_bandwidth_gbps if ds.mem_bandwidth_gbps > 1e-6 else 1e-6) * 1e9
            d.t_tg = max(tg_flops / gf, tg_bytes / bw) + overhead
            d.out_tg = max(out_flops / gf, out_bytes / bw) + overhead
            free = ds.free_bytes / margin
            d.cap = _fit_layers(free, cb, per_layer, n_layer)
            d.cap_out = _fit_layers(free, out_fixed, per_layer, n_layer)
            d.pcap = _fit_layers(free, pcb, per_layer, n_layer)
            d.pcap_out = _fit_layers(free, pout_fixed, per_layer, n_layer)
            devs.append(d)
            if node._cpu is None and ds.kind == "cpu":
                node._cpu = d
            else:
                node._gpus.append(d)
            best = node._best_out
            if d.cap_out > 0 and (best is None or d.out_tg + d.t_tg < best.out_tg + best.t_tg):
                node._best_out = d
        devs.sort(key=lambda d: (d.t_tg, d.order))
        node._devs = devs

    def release(self) -> None:
        """Break the node <-> device and node <-> context reference cycles once a decision is
        made, so reference counting frees them at once. Left to the cyclic collector, a 1,000-node
        decision's garbage made its full collections the p99 of the decision time."""
        for node in self.nodes:
            node._devs = None
            node._cpu = None
            node._gpus = []
            node._best_out = None
        self.nodes = []
        self.by_id = {}
        self._ranking = None

    def remote_ranking(self) -> list[_Node]:
        """Nodes with room, best per-layer cost first assuming the default link."""
        if self._ranking is None:
            hop = self._default_hops[0]
            n_layer = self.n_layer
            usable = [n for n in self.nodes if n.total_cap > 0]
            usable.sort(key=lambda n: (n.best_t + hop / min(n.total_cap, n_layer), n.snap.node_id))
            self._ranking = usable
        return self._ranking

    def hop(self, primary: _Node, node: _Node, holds_output: bool) -> float:
        key = (id(primary), id(node), holds_output)
        h = self._hop_cache.get(key)
        if h is None:
            a, b = primary.snap.node_id, node.snap.node_id
            links = self.cluster.links
            link = links.get((a, b)) or links.get((b, a)) if links else None
            if a == b:
                h = 0.0
            elif link is None:
                h = self._default_hops[holds_output]
            else:
                h = hop_s(
                    self.profile,
                    self.request,
                    link,
                    holds_output=holds_output,
                    prompt=False,
                    cost=self.cost,
                )
            self._hop_cache[key] = h
        return h


@dataclass
class _Eval:
    cost_s: float
    unplaced: int
    primary: _Node
    assign: dict[int, int]  # id(_Dev) → layers
    devs: dict[int, _Dev]
    out: _Dev | None  # None: nothing offloaded, the output stays on the primary's CPU
    remote: list[_Node]  # remote nodes holding layers
    pipeline: bool = False  # ggml pipelines (and copies compute buffers) across devices

    @property
    def feasible(self) -> bool:
        return self.unplaced == 0

    @property
    def n_nodes(self) -> int:
        return 1 + len(self.remote)

    @property
    def key(self) -> tuple[int, float]:
        return (self.unplaced, self.cost_s)


def _infeasible(ctx: _Ctx, primary: _Node, out: _Dev | None = None) -> _Eval:
    return _Eval(math.inf, ctx.n_layer, primary, {}, {}, out, [])


def _fill(
    ctx: _Ctx,
    primary: _Node,
    remote: Sequence[_Node],
    out: _Dev | None,
    spread: bool,
    pipeline: bool = False,
) -> _Eval:
    """Fastest-first fill under memory caps for a fixed primary, remote set and output device.

    A plan's decode latency is linear in the layer counts (Σ layers × per-layer time), so for a
    given set of devices filling the fastest device to its cap first is optimal; the hop costs
    depend only on which remote nodes end up holding layers.
    """
    n_layer = ctx.n_layer
    cpu = primary.cpu
    if cpu is None:
        return _infeasible(ctx, primary, out)
    # (per-layer time, tie-break, device, cap): sorting the tuples never reaches the device.
    pool: list[tuple[float, int, _Dev, int]] = []
    if out is None:
        # Everything on the primary's CPU, output included: a plain local llama.cpp run.
        if primary.cap_alone > 0:
            pool.append((cpu.t_tg, cpu.order, cpu, primary.cap_alone))
    else:
        if primary.cap_primary > 0:
            pool.append((cpu.t_tg, cpu.order, cpu, primary.cap_primary))
        # llama.cpp puts local GPUs after every RPC device, so with the output on a remote
        # device the primary's GPUs cannot hold layers.
        nodes = remote if out.node is not primary else (primary, *remote)
        for node in nodes:
            for d in node.devs:
                if d is cpu:
                    continue
                if pipeline:
                    c = d.pcap_out if d is out else d.pcap
                else:
                    c = d.cap_out if d is out else d.cap
                if c > 0:
                    pool.append((d.t_tg, d.order, d, c))
        pool.sort()
    counts = [0] * len(pool)
    need = n_layer
    if out is not None:
        i_out = next((i for i, e in enumerate(pool) if e[2] is out), -1)
        if i_out < 0:
            return _infeasible(ctx, primary, out)
        counts[i_out] = 1
        need -= 1
    if spread:
        for node in (primary, *remote):
            if out is not None and out.node is node:
                continue
            first = next((i for i, e in enumerate(pool) if e[2].node is node), -1)
            if first < 0 or need == 0:
                return _infeasible(ctx, primary, out)
            counts[first] = 1
            need -= 1
    for i, (_, _, _, cap) in enumerate(pool):
        if need == 0:
            break
        take = cap - counts[i]
        if take > need:
            take = need
        if take > 0:
            counts[i] += take
            need -= take
    total = 0.0
    used_remote: list[_Node] = []
    assign: dict[int, int] = {}
    devs: dict[int, _Dev] = {}
    over_pipeline = False
    for (t, _, d, _), c in zip(pool, counts, strict=True):
        if c == 0:
            continue
        total += c * t
        assign[id(d)] = c
        devs[id(d)] = d
        if c > (d.pcap_out if d is out else d.pcap):
            over_pipeline = True
        node = d.node
        if node is not primary and node not in used_remote:
            used_remote.append(node)
    total += (out or cpu).out_tg
    for node in used_remote:
        total += ctx.hop(primary, node, out is not None and out.node is node)
    if spread and len(used_remote) != len(remote):
        return _infeasible(ctx, primary, out)
    ev = _Eval(
        total + need * _UNPLACED_LAYER_PENALTY_S, need, primary, assign, devs, out, used_remote
    )
    if (
        not pipeline
        and out is not None
        and need == 0
        and id(cpu) not in assign
        and len(assign) > 1
        and ctx.cost.pipeline_copies > 1
    ):
        # Every layer offloaded to two or more devices: llama.cpp turns on pipeline parallelism,
        # which keeps copies of each split's inputs. Refill against those caps when needed.
        if over_pipeline:
            ev = _fill(ctx, primary, remote, out, spread, pipeline=True)
        ev.pipeline = True
    return ev


def _output_candidates(
    ctx: _Ctx, primary: _Node, remote: Sequence[_Node], every: bool
) -> list[_Dev | None]:
    """Where the output layer may go: nowhere else (no offload), a local GPU or a remote device.

    With every=False only each node's best output device is tried (the search's fast path);
    the final plan and exhaustive_best try them all.
    """
    cands: list[_Dev | None] = []
    if not remote:
        cands.append(None)
    if every:
        cands.extend(g for g in primary.gpus if g.cap_out > 0)
        for node in reversed(remote):
            cands.extend(d for d in node.devs if d.cap_out > 0)
        return cands
    gpus = [g for g in primary.gpus if g.cap_out > 0]
    if gpus:
        cands.append(min(gpus, key=lambda g: (g.out_tg + g.t_tg, g.order)))
    # Only the two remote nodes where the output costs least (logits back over their link, the
    # LM head on their best device). Reversed first: on a tie the output goes to the last node.
    ranked = sorted(
        (
            (
                ctx.hop(primary, n, True) - ctx.hop(primary, n, False) + n.best_out.out_tg,
                -i,
                n.best_out,
            )
            for i, n in enumerate(remote)
            if n.best_out is not None
        ),
        key=lambda t: (t[0], t[1]),
    )
    cands.extend(t[2] for t in ranked[:2])
    return cands


def _evaluate(
    ctx: _Ctx, primary: _Node, remote: Sequence[_Node], spread: bool = False, every: bool = True
) -> _Eval:
    """Best plan for a fixed primary and remote node set, over the output placements."""
    if not primary.primary_ok:
        return _infeasible(ctx, primary)
    best: _Eval | None = None
    for out in _output_candidates(ctx, primary, remote, every):
        ev = _fill(ctx, primary, remote, out, spread)
        if best is None or ev.key < best.key:
            best = ev
    return best if best is not None else _infeasible(ctx, primary)


# --- eligibility ------------------------------------------------------------------------------


def _select_nodes(
    cluster: ClusterSnapshot, request: PlacementRequest
) -> tuple[list[NodeSnapshot], list[NodeSnapshot], list[str]]:
    """(ready nodes, degraded fallbacks, explanation lines) after pins, exclusions and states."""
    by_id = {n.node_id: n for n in cluster.nodes}
    notes: list[str] = []
    excluded = set(request.exclude_nodes)
    if request.pin_nodes is not None:
        unknown = [p for p in request.pin_nodes if p not in by_id]
        if unknown:
            raise PlacementRefused(f"unknown pinned nodes: {', '.join(unknown)}", 0, ())
        both = [p for p in request.pin_nodes if p in excluded]
        if both:
            raise PlacementRefused(f"pinned nodes are also excluded: {', '.join(both)}", 0, ())
        candidates = [by_id[p] for p in dict.fromkeys(request.pin_nodes)]
        bad = [n for n in candidates if n.state not in ELIGIBLE_STATES | FALLBACK_STATES]
        if bad:
            raise PlacementRefused(
                "pinned nodes cannot take new work: "
                + ", ".join(f"{n.name or n.node_id} ({n.state})" for n in bad),
                0,
                (),
            )
        serving = [n for n in candidates if n.serves_model]
        if serving and not request.allow_same_node:
            raise PlacementRefused(
                "pinned nodes already serve this model: "
                + ", ".join(n.name or n.node_id for n in serving)
                + " (one replica per node; allow_same_node places another copy there)",
                0,
                tuple(n.node_id for n in serving),
                code="already_served",
            )
    else:
        candidates = [n for n in cluster.nodes if n.node_id not in excluded]
        if excluded:
            gone = [e for e in request.exclude_nodes if e in by_id]
            if gone:
                notes.append(f"excluded by request: {', '.join(gone)}")
        serving = [n for n in candidates if n.serves_model]
        if serving and not request.allow_same_node:
            candidates = [n for n in candidates if not n.serves_model]
            names = [n.name or n.node_id for n in serving]
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            notes.append(f"already serve this model (one replica per node): {shown}")
    ready = [n for n in candidates if n.state in ELIGIBLE_STATES]
    degraded = [n for n in candidates if n.state in FALLBACK_STATES]
    skipped = [n for n in candidates if n.state not in ELIGIBLE_STATES | FALLBACK_STATES]
    if skipped:
        by_state: dict[str, list[str]] = {}
        for n in skipped:
            by_state.setdefault(n.state, []).append(n.name or n.node_id)
        parts = []
        for state, names in sorted(by_state.items()):
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{state}: {shown}")
        notes.append("never placed on: " + "; ".join(parts))
    return ready, degraded, notes


# --- the scheduler ----------------------------------------------------------------------------

_PRIMARY_CANDIDATES = 6
# Up to this many nodes every node is tried as the primary (the bench's clusters are 2-8).
_SMALL_CLUSTER = 12
_REMOTE_POOL = 14
_SWAP_ROUNDS = 3


def _prefer(ctx: _Ctx, evals: Iterable[_Eval]) -> _Eval | None:
    """Fastest feasible plan, except that fewer nodes, then a primary holding the file, win a
    near tie (cost.prefer_fewer_tolerance)."""
    feasible = [e for e in evals if e.feasible]
    if not feasible:
        return None
    best = min(e.cost_s for e in feasible)
    near = [e for e in feasible if e.cost_s <= best * (1 + ctx.cost.prefer_fewer_tolerance)]
    near.sort(
        key=lambda e: (
            e.n_nodes,
            not e.primary.snap.has_model_file,
            e.cost_s,
            e.primary.snap.node_id,
        )
    )
    return near[0]


def _remote_pool(ctx: _Ctx, primary: _Node, nodes: Sequence[_Node], size: int) -> list[_Node]:
    """Remote nodes worth trying with this primary: cheapest per layer once the hop is shared.

    Ranked first with the default link (one ranking per decision), then the head of that
    ranking is re-scored with this primary's probed links: O(size) per primary, not O(nodes).
    """
    n_layer = ctx.n_layer
    ranking = ctx.remote_ranking()
    head: list[_Node] = []
    for node in ranking:
        if node is not primary:
            head.append(node)
            if len(head) >= 4 * size:
                break
    hop = ctx.hop
    scored = sorted(
        head,
        key=lambda n: (
            n.best_t + hop(primary, n, False) / min(n.total_cap, n_layer),
            n.snap.node_id,
        ),
    )
    pool = scored[:size]
    # Big models need many nodes: widen the pool until it could hold the model twice over.
    cap_total = sum(n.total_cap for n in pool)
    if cap_total < 2 * n_layer:
        chosen = set(map(id, pool))
        for node in ranking:
            if cap_total >= 2 * n_layer:
                break
            if node is primary or id(node) in chosen:
                continue
            pool.append(node)
            cap_total += node.total_cap
    return pool


def _better(a: _Eval, b: _Eval) -> bool:
    """a predicts strictly faster than b (capacity first while either is infeasible)."""
    return a.unplaced < b.unplaced or (
        a.unplaced == b.unplaced and a.cost_s < b.cost_s * (1 - 1e-9)
    )


def _may_help(ctx: _Ctx, primary: _Node, node: _Node, cur: _Eval) -> bool:
    """False when adding node to a feasible plan cannot predict faster: each layer it could take
    saves at most (slowest used device - its best device) and its hop costs more, and holding
    the output there (LM head + logits over its link) is no cheaper than where it is now."""
    if not cur.feasible or node.total_cap <= 0:
        return node.total_cap > 0
    slowest = max((cur.devs[k].t_tg for k in cur.assign), default=math.inf)
    gain = (slowest - node.best_t) * min(node.total_cap, ctx.n_layer)
    if gain > ctx.hop(primary, node, False):
        return True
    best_out = node.best_out
    if best_out is None:
        return False
    out = cur.out
    if out is None:
        return False  # a plain local run: a remote output only adds a hop
    now = out.out_tg
    if out.node is not primary:
        now += ctx.hop(primary, out.node, True) - ctx.hop(primary, out.node, False)
    return best_out.out_tg + ctx.hop(primary, node, True) < now + slowest


def _local_search(ctx: _Ctx, primary: _Node, pool: Sequence[_Node], notes: list[str]) -> _Eval:
    """Greedy add of remote nodes, then drop and swap passes; each step must predict faster."""
    current: list[_Node] = []
    cur = _evaluate(ctx, primary, current, every=False)
    # Add: the node that improves the prediction most (capacity first while infeasible).
    while True:
        best_ev, best_node = None, None
        for node in pool:
            if node in current or not _may_help(ctx, primary, node, cur):
                continue
            ev = _evaluate(ctx, primary, [*current, node], every=False)
            if best_ev is None or ev.key < best_ev.key:
                best_ev, best_node = ev, node
        if best_ev is None or best_node is None or not _better(best_ev, cur):
            break
        current.append(best_node)
        cur = best_ev
        if cur.feasible:
            # Nodes that ended up with no layers are not part of the plan.
            current = [n for n in current if n in cur.remote]
    dropped: list[tuple[_Node, float, float]] = []
    for _ in range(_SWAP_ROUNDS):
        changed = False
        # Drop: any node whose removal predicts faster (or equal: fewer nodes is simpler).
        for node in list(current):
            rest = [n for n in current if n is not node]
            ev = _evaluate(ctx, primary, rest, every=False)
            if ev.key <= cur.key:
                if cur.feasible:
                    dropped.append((node, cur.cost_s, ev.cost_s))
                current, cur, changed = rest, ev, True
        # Swap: replace one node by an unused one when that predicts faster.
        best_swap: tuple[_Eval, list[_Node]] | None = None
        for node in current:
            rest = [n for n in current if n is not node]
            for other in pool:
                if other in current or not _may_help(ctx, primary, other, cur):
                    continue
                ev = _evaluate(ctx, primary, [*rest, other], every=False)
                if _better(ev, best_swap[0] if best_swap else cur):
                    best_swap = (ev, [*rest, other])
        if best_swap is not None:
            cur, current, changed = best_swap[0], best_swap[1], True
            # A swap may have freed room for another helpful node.
            for node in pool:
                if node in current or not _may_help(ctx, primary, node, cur):
                    continue
                ev = _evaluate(ctx, primary, [*current, node], every=False)
                if _better(ev, cur):
                    current, cur = [*current, node], ev
        if not changed:
            break
    # The final set gets the full output search (every device as a candidate).
    cur = _evaluate(ctx, primary, current)
    # Fewer nodes win a near tie: remove nodes while within tolerance of the best found.
    limit = cur.cost_s * (1 + ctx.cost.prefer_fewer_tolerance)
    improved = True
    while improved and cur.feasible and current:
        improved = False
        for node in list(current):
            rest = [n for n in current if n is not node]
            ev = _evaluate(ctx, primary, rest)
            if ev.feasible and ev.cost_s <= limit:
                dropped.append((node, cur.cost_s, ev.cost_s))
                current, cur, improved = rest, ev, True
                break
    for node, before, after in dropped:
        if node in current or not math.isfinite(before) or not math.isfinite(after):
            continue
        notes.append(
            f"dropped {node.snap.name or node.snap.node_id} with primary "
            f"{primary.snap.name or primary.snap.node_id}: predicted {1 / before:.1f} → "
            f"{1 / after:.1f} tok/s without it"
        )
    return cur


def _primary_candidates(ctx: _Ctx, nodes: Sequence[_Node], k: int) -> list[_Node]:
    """Primaries worth a local search: all of them in a small cluster, else a shortlist."""
    ok = [n for n in nodes if n.primary_ok]
    if len(ok) <= _SMALL_CLUSTER:
        return ok
    picked: dict[str, _Node] = {}
    # Nodes that can run the model alone, fastest first.
    for n in heapq.nsmallest(k // 2, ok, key=lambda n: (n.alone_est, n.index)):
        if math.isfinite(n.alone_est):
            picked[n.snap.node_id] = n
    # Then the nodes with the fastest devices and room: good hubs for a split.
    by_speed = heapq.nsmallest(4 * k, ok, key=lambda n: (n.best_t, -n.total_cap, n.index))
    for n in by_speed:
        if len(picked) >= k:
            break
        picked.setdefault(n.snap.node_id, n)
    # And the best of those already holding the file: no copy needed if they tie.
    for n in [n for n in by_speed if n.snap.has_model_file][:2]:
        picked.setdefault(n.snap.node_id, n)
    return list(picked.values())


def _search(ctx: _Ctx, spread: bool, notes: list[str]) -> tuple[_Eval | None, _Eval | None]:
    """(best feasible evaluation or None, best infeasible attempt for a refusal)."""
    nodes = ctx.nodes
    evals: list[_Eval] = []
    if spread:
        for p in nodes:
            evals.append(_evaluate(ctx, p, [n for n in nodes if n is not p], spread=True))
    else:
        per_primary: dict[int, list[str]] = {}
        tried: set[int] = set()

        def search_from(p: _Node) -> None:
            tried.add(id(p))
            pool = _remote_pool(ctx, p, nodes, _REMOTE_POOL)
            lines: list[str] = []
            ev = _local_search(ctx, p, pool, lines)
            per_primary[id(ev)] = lines
            evals.append(ev)

        for p in _primary_candidates(ctx, nodes, _PRIMARY_CANDIDATES):
            search_from(p)
        # Re-root: the members of the best split may make a better primary (links are measured
        # from the primary, since every activation passes through it).
        best = _prefer(ctx, evals)
        if best is not None:
            for node in best.remote:
                if id(node) not in tried and node.primary_ok:
                    search_from(node)
    chosen = _prefer(ctx, evals)
    if chosen is not None and not spread:
        notes.extend(per_primary.get(id(chosen), []))
    attempt = min(evals, key=lambda e: e.key, default=None)
    return chosen, attempt


def _tiers(
    request: PlacementRequest, ready: list[NodeSnapshot], degraded: list[NodeSnapshot]
) -> list[tuple[list[NodeSnapshot], bool]]:
    """Node sets to try in turn, each with whether it includes DEGRADED nodes."""
    if request.spread and request.pin_nodes is not None:
        # The operator named the nodes: every one of them takes part, DEGRADED included.
        return [(ready + degraded, bool(degraded))]
    tiers: list[tuple[list[NodeSnapshot], bool]] = []
    if ready:
        tiers.append((ready, False))
    if degraded:
        tiers.append((ready + degraded, True))
    return tiers


def plan_placement(
    profile: ModelProfile,
    cluster: ClusterSnapshot,
    request: PlacementRequest | None = None,
    *,
    cost: CostModel = DEFAULT_COST,
) -> Plan:
    """Place the model on the cluster or raise PlacementRefused saying what is missing.

    With request.n_parallel None the slots are chosen from memory (see _finish_plan); a fixed
    n_parallel that does not fit, where fewer slots would, is refused naming how many fit.
    """
    asked = request or PlacementRequest()
    _check_request(profile, asked)
    request = _search_request(asked)
    ready, degraded, notes = _select_nodes(cluster, request)
    tiers = _tiers(request, ready, degraded)
    if not tiers or not any(t[0] for t in tiers):
        raise PlacementRefused(
            "no eligible nodes" + (f" ({'; '.join(notes)})" if notes else ""), 0, ()
        )
    if request.spread and len(tiers[0][0]) > profile.n_layer:
        raise PlacementRefused(
            f"cannot spread {profile.n_layer} layers over {len(tiers[0][0])} nodes", 0, ()
        )
    attempt: _Eval | None = None
    attempt_ctx: _Ctx | None = None
    contexts: list[_Ctx] = []
    try:
        for nodes, uses_degraded in tiers:
            ctx = _Ctx(profile, cluster, request, nodes, cost)
            contexts.append(ctx)
            search_notes: list[str] = []
            chosen, tried = _search(ctx, request.spread, search_notes)
            if chosen is not None:
                if uses_degraded:
                    used = {chosen.primary.snap.node_id, *(n.snap.node_id for n in chosen.remote)}
                    names = [n.name or n.node_id for n in degraded if n.node_id in used]
                    if names and request.pin_nodes is None:
                        notes.append(
                            "DEGRADED nodes used because the READY nodes alone cannot hold the "
                            f"model: {', '.join(names)}"
                        )
                    elif names:
                        notes.append(
                            f"DEGRADED nodes used because the spread names them: {', '.join(names)}"
                        )
                elif degraded:
                    notes.append(
                        "not used (DEGRADED, fallback only): "
                        + ", ".join(n.name or n.node_id for n in degraded[:5])
                        + (f" and {len(degraded) - 5} more" if len(degraded) > 5 else "")
                    )
                return _finish_plan(ctx, chosen, notes + search_notes, asked)
            if attempt_ctx is None or (
                tried is not None and (attempt is None or tried.unplaced <= attempt.unplaced)
            ):
                attempt, attempt_ctx = tried, ctx
        refusal = _refusal(attempt_ctx, attempt, notes)
    finally:
        for c in contexts:
            c.release()
    if asked.n_parallel is not None and asked.n_parallel > 1:
        raise _too_many_slots(profile, cluster, asked, cost) or refusal
    raise refusal


def _search_request(asked: PlacementRequest) -> PlacementRequest:
    """The request the search runs with: one slot when the slots are left to memory."""
    return dataclasses.replace(asked, n_parallel=1) if asked.n_parallel is None else asked


def _too_many_slots(
    profile: ModelProfile, cluster: ClusterSnapshot, asked: PlacementRequest, cost: CostModel
) -> PlacementRefused | None:
    """The refusal for a fixed n_parallel that memory cannot hold while fewer slots fit, naming
    the most that fit and the device that runs out; None when even one slot does not fit."""
    n = int(asked.n_parallel or 1)
    try:
        fewer = plan_placement(
            profile,
            cluster,
            dataclasses.replace(asked, n_parallel=None, max_parallel=n - 1),
            cost=cost,
        )
    except PlacementRefused:
        return None
    best = fewer.n_parallel
    # The layout chosen for one slot is not always the one that holds the most: bisect over
    # full searches between what that layout holds and n - 1 (a handful of runs, refusals only).
    lo, hi = best, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            plan_placement(profile, cluster, dataclasses.replace(asked, n_parallel=mid), cost=cost)
        except PlacementRefused:
            hi = mid - 1
        else:
            lo = mid
    best = lo
    kv_per_slot_layer = profile.kv_bytes_per_token_per_layer * asked.n_ctx
    margin = 1.0 + max(0.0, asked.memory_margin)
    names = {nd.node_id: nd.name or nd.node_id for nd in cluster.nodes}

    def excess(d: PlanDevice) -> float:
        return (
            d.memory_bytes
            + (n - fewer.n_parallel) * d.n_layers * kv_per_slot_layer * margin
            - d.free_bytes
        )

    tight = max(fewer.devices, key=excess)
    need = tight.n_layers * kv_per_slot_layer * n
    return PlacementRefused(
        f"n_parallel {n} needs {fmt_bytes(need)} of KV on {names.get(tight.node_id, tight.node_id)} "
        f"{tight.device} ({fmt_bytes(tight.free_bytes)} free); at most {best} slots fit "
        f"at n_ctx {asked.n_ctx}",
        int(max(0.0, excess(tight))),
        (tight.node_id,),
        code="n_parallel_too_large",
        limit=best,
    )


def _check_request(profile: ModelProfile, request: PlacementRequest) -> None:
    bad = [
        f"{name} must be at least 1 (got {value})"
        for name, value in (
            ("n_ctx", request.n_ctx),
            ("n_parallel", request.n_parallel if request.n_parallel is not None else 1),
            ("max_parallel", request.max_parallel),
            ("n_batch", request.n_batch),
        )
        if value <= 0
    ]
    if bad:
        raise PlacementRefused("; ".join(bad), 0, (), code="invalid_request")
    if profile.n_layer <= 0:
        raise PlacementRefused("the model has no layers", 0, ())


def _refusal(ctx: _Ctx | None, attempt: _Eval | None, notes: list[str]) -> PlacementRefused:
    tail = f" ({'; '.join(notes)})" if notes else ""
    if ctx is None or not ctx.nodes:
        return PlacementRefused("no eligible nodes" + tail, 0, ())
    if not any(n.primary_ok for n in ctx.nodes):
        biggest = max(ctx.nodes, key=lambda n: n.cpu.snap.free_bytes if n.cpu else 0)
        have = biggest.cpu.snap.free_bytes if biggest.cpu else 0
        need = int(ctx.host_fixed_idle * ctx.margin)
        return PlacementRefused(
            f"needs {fmt_bytes(need - have)} more memory: no node's RAM can hold the embeddings and "
            f"host buffers ({fmt_bytes(need)}); largest is {biggest.snap.name or biggest.snap.node_id} "
            f"({fmt_bytes(have)} free){tail}",
            need - have,
            (biggest.snap.node_id,),
        )
    if attempt is None:
        return PlacementRefused("no eligible nodes" + tail, 0, ())
    used = [attempt.primary, *attempt.remote]
    # An infeasible attempt may list nodes that could not take a layer; show the whole set tried.
    for k in attempt.assign:
        node = attempt.devs[k].node
        if node not in used:
            used.append(node)
    missing = int(attempt.unplaced * ctx.per_layer * ctx.margin)
    if attempt.unplaced >= ctx.n_layer:
        # Nothing could be placed at all (spread over a node without room, for instance).
        missing = int((ctx.n_layer * ctx.per_layer + ctx.out_fixed) * ctx.margin)
    used.sort(key=lambda n: -n.snap.free_bytes)
    shown = ", ".join(
        f"{n.snap.name or n.snap.node_id} ({fmt_bytes(n.snap.free_bytes)} free)" for n in used[:6]
    )
    if len(used) > 6:
        shown += f" and {len(used) - 6} more"
    return PlacementRefused(
        f"needs {fmt_bytes(missing)} more memory; largest feasible set is {shown}{tail}",
        missing,
        tuple(n.snap.node_id for n in used),
    )


# --- plan assembly ----------------------------------------------------------------------------


def _ordered_devices(ev: _Eval, ctx_nodes: Sequence[_Node]) -> list[tuple[_Dev, int]]:
    """The evaluation's devices in llama.cpp's order: primary CPU, remote nodes, primary GPUs."""
    primary = ev.primary
    counts = {k: c for k, c in ev.assign.items() if c > 0}
    out = ev.out

    def node_devices(node: _Node) -> list[tuple[_Dev, int]]:
        ds = [(d, counts[id(d)]) for d in node.devs if id(d) in counts and d is not node.cpu]
        cpu = node.cpu
        if cpu is not None and id(cpu) in counts and node is not primary:
            ds.insert(0, (cpu, counts[id(cpu)]))
        # The output device runs last within its node.
        ds.sort(key=lambda t: t[0] is out)
        return ds

    order: list[tuple[_Dev, int]] = []
    assert primary.cpu is not None
    order.append((primary.cpu, counts.get(id(primary.cpu), 0)))
    # Remote order does not change the cost (every hop goes through the primary), so keep the
    # cluster's order, with the node holding the output last as llama.cpp requires.
    rank = {id(n): i for i, n in enumerate(ctx_nodes)}
    remote = sorted(
        ev.remote, key=lambda n: (out is not None and out.node is n, rank.get(id(n), 0))
    )
    for node in remote:
        order.extend(node_devices(node))
    order.extend(node_devices(primary))
    return order


def _device_memory(
    ctx: _Ctx,
    ev: _Eval,
    d: _Dev,
    start: int,
    end: int,
    holds_output: bool,
    is_primary_cpu: bool,
    copies: int,
    request: PlacementRequest | None = None,
) -> int:
    profile = ctx.profile
    request = request or ctx.request
    n = end - start
    raw = sum(profile.layer_bytes[start:end]) + n * kv_bytes_per_layer(profile, request)
    if is_primary_cpu:
        raw += host_buffer_bytes(profile, request)
        if ev.out is None:
            raw += profile.output_bytes + compute_buffer_bytes(
                profile, request, holds_layers=True, holds_output=True, cost=ctx.cost
            )
        else:
            raw += compute_buffer_bytes(
                profile,
                request,
                holds_layers=n > 0,
                holds_output=False,
                copies=copies,
                cost=ctx.cost,
            )
    else:
        if holds_output:
            raw += profile.output_bytes
        raw += compute_buffer_bytes(
            profile,
            request,
            holds_layers=n > 0,
            holds_output=holds_output,
            copies=copies,
            cost=ctx.cost,
        )
    return int(math.ceil(raw * ctx.margin))


def _predict(ctx: _Ctx, ev: _Eval, order: list[tuple[_Dev, int]]) -> tuple[float, float]:
    """(decode seconds per token, prompt seconds) for the plan as laid out."""
    profile, request = ctx.profile, ctx.request
    tg = pp = 0.0
    passes = math.ceil(max(1, request.prompt_tokens) / request.n_batch)
    overhead = ctx.cost.layer_overhead_ms / 1000
    for d, c in order:
        tg += c * d.t_tg
        if c:
            pp += c * (layer_times(profile, request, d.snap)[1] + passes * overhead)
    out_dev = ev.out if ev.out is not None else ev.primary.cpu
    assert out_dev is not None
    tg += out_dev.out_tg
    pp += out_dev.out_tg
    for node in ev.remote:
        link = ctx.cluster.link(ev.primary.snap.node_id, node.snap.node_id)
        holds = ev.out is not None and ev.out.node is node
        tg += hop_s(profile, request, link, holds_output=holds, prompt=False, cost=ctx.cost)
        pp += hop_s(profile, request, link, holds_output=holds, prompt=True, cost=ctx.cost)
    return tg, pp


def _layout(ctx: _Ctx, ev: _Eval) -> list[tuple[_Dev, int, int, bool, bool]]:
    """(device, layer_start, layer_end, holds_output, is_primary_cpu) in llama.cpp's order."""
    out: list[tuple[_Dev, int, int, bool, bool]] = []
    start = 0
    for i, (d, c) in enumerate(_ordered_devices(ev, ctx.nodes)):
        is_primary_cpu = i == 0
        holds_output = (ev.out is d) or (ev.out is None and is_primary_cpu)
        out.append((d, start, start + c, holds_output, is_primary_cpu))
        start += c
    return out


def _overflowing_device(
    ctx: _Ctx, ev: _Eval, layout: list[tuple[_Dev, int, int, bool, bool]], n_parallel: int
) -> _Dev | None:
    """The first device of the plan whose memory with n_parallel slots exceeds its free bytes."""
    req = dataclasses.replace(ctx.request, n_parallel=n_parallel)
    copies = ctx.cost.pipeline_copies if ev.pipeline else 1
    for d, start, end, holds_output, is_primary_cpu in layout:
        mem = _device_memory(ctx, ev, d, start, end, holds_output, is_primary_cpu, copies, req)
        if mem > d.snap.free_bytes:
            return d
    return None


def _slots_that_fit(ctx: _Ctx, ev: _Eval, limit: int) -> int:
    """The most slots (1..limit) whose KV fits on every device of the plan as laid out.

    Memory grows with the slot count on every device (KV per layer, the logits buffer), so the
    largest fitting count is found by bisection. 0 when not even one slot fits.
    """
    layout = _layout(ctx, ev)
    if _overflowing_device(ctx, ev, layout, 1) is not None:
        return 0
    lo, hi = 1, max(1, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _overflowing_device(ctx, ev, layout, mid) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _finish_plan(ctx: _Ctx, ev: _Eval, notes: list[str], asked: PlacementRequest) -> Plan:
    """Build the plan; when the request left n_parallel open, with as many slots as fit.

    The search ran with one slot (ctx.request): layers go where they run fastest, and the slots
    take what memory is left on the devices chosen, capped at asked.max_parallel.
    """
    if asked.n_parallel is not None:
        return _build_plan(ctx, ev, [*notes, f"slots: {asked.n_parallel} (set by the request)"])
    fit = _slots_that_fit(ctx, ev, max(1, asked.max_parallel))
    n = max(1, fit)
    line = f"slots: {n} of {ctx.request.n_ctx} tokens each (the KV of every slot fits every device"
    line += f"; capped at {asked.max_parallel})" if n >= asked.max_parallel else ")"
    return _build_plan(
        ctx, ev, [*notes, line], request=dataclasses.replace(ctx.request, n_parallel=n)
    )


def _build_plan(
    ctx: _Ctx, ev: _Eval, notes: list[str], request: PlacementRequest | None = None
) -> Plan:
    profile = ctx.profile
    request = request or ctx.request
    primary = ev.primary
    layout = _layout(ctx, ev)
    order = [(d, end - start) for d, start, end, _, _ in layout]
    offload = order[1:]
    copies = ctx.cost.pipeline_copies if ev.pipeline else 1
    devices: list[PlanDevice] = []
    for d, start, end, holds_output, is_primary_cpu in layout:
        mem = _device_memory(ctx, ev, d, start, end, holds_output, is_primary_cpu, copies, request)
        node = d.node.snap
        devices.append(
            PlanDevice(
                node_id=node.node_id,
                device=d.snap.device,
                kind=d.snap.kind,
                layer_start=start,
                layer_end=end,
                memory_bytes=mem,
                endpoint=None if d.node is primary else node.endpoint,
                holds_output=holds_output,
                free_bytes=d.snap.free_bytes,
            )
        )
    start = layout[-1][2] if layout else 0
    assert start == profile.n_layer, "every layer is placed exactly once"
    k = order[0][1]
    if offload:
        n_gpu_layers = profile.n_layer + 1 - k
        split = [float(c) for _, c in offload]
        split[-1] += 1.0  # the output layer counts as one more on the last offload device
    else:
        n_gpu_layers, split = 0, []
    tg, pp = _predict(ctx, ev, order)
    explanation = _explain(ctx, ev, devices, tg, notes)
    return Plan(
        primary_node_id=primary.snap.node_id,
        devices=tuple(devices),
        tensor_split=tuple(split),
        n_gpu_layers=n_gpu_layers,
        n_threads=max(1, primary.snap.threads),
        n_ctx=request.n_ctx,
        n_parallel=request.n_parallel or 1,
        n_batch=min(request.n_batch, request.n_ctx),
        flash_attn=request.flash_attn,
        predicted_ttft_ms=round(pp * 1000, 3),
        predicted_tokens_per_s=round(1.0 / tg, 3) if tg > 0 else math.inf,
        explanation=tuple(explanation),
    )


def _explain(
    ctx: _Ctx, ev: _Eval, devices: list[PlanDevice], tg: float, notes: list[str]
) -> list[str]:
    lines: list[str] = []
    primary = ev.primary.snap
    holds = (
        " (already holds the model file)"
        if primary.has_model_file
        else " (the model file will be copied there)"
    )
    lines.append(f"primary: {primary.name or primary.node_id}{holds}")
    for d in devices:
        if d.n_layers == 0 and d.endpoint is None:
            lines.append(
                f"{d.node_id} {d.device}: embeddings and host buffers only, {fmt_bytes(d.memory_bytes)} "
                f"of {fmt_bytes(d.free_bytes)} free"
            )
            continue
        where = "local" if d.endpoint is None else f"via RPC {d.endpoint}"
        out = ", output layer" if d.holds_output else ""
        lines.append(
            f"{d.node_id} {d.device} ({where}): layers {d.layer_start}-{d.layer_end - 1}{out}, "
            f"{fmt_bytes(d.memory_bytes)} of {fmt_bytes(d.free_bytes)} free"
        )
    layer_devs = [d for d in devices if d.n_layers > 0]
    n_nodes = len({d.node_id for d in devices})
    if n_nodes == 1 and len(layer_devs) <= 1:
        lines.append("fits on one device: the fastest device that holds the whole model")
    elif n_nodes == 1:
        lines.append(
            "one node: its fastest device is filled first, the rest of the layers go to its next device"
        )
    else:
        lines.append(
            f"split over {n_nodes} nodes: no smaller set holds the model as fast "
            f"(layers go to the fastest devices first, up to their memory)"
        )
    used = {d.node_id for d in devices}
    others = [n for n in ctx.nodes if n.snap.node_id not in used]
    slowest_used = max((ev.devs[k].t_tg for k, c in ev.assign.items() if c > 0), default=0.0)
    if others:
        if len(others) <= 5:
            for n in others:
                if n.total_cap <= 0:
                    why = "too little free memory for even one layer"
                elif n.best_t >= slowest_used:
                    why = "slower than every device used"
                else:
                    why = "not needed: adding it does not predict faster"
                lines.append(f"not used: {n.snap.name or n.snap.node_id} ({why})")
        else:
            lines.append(
                f"not used: {len(others)} other eligible nodes (slower, smaller or not needed)"
            )
    lines.extend(notes)
    lines.append(f"predicted {1 / tg:.1f} tokens/s per stream" if tg > 0 else "predicted: instant")
    return lines


# --- references for tests and the benchmark ---------------------------------------------------


def exhaustive_best(
    profile: ModelProfile,
    cluster: ClusterSnapshot,
    request: PlacementRequest | None = None,
    *,
    cost: CostModel = DEFAULT_COST,
    max_nodes: int = 10,
) -> Plan:
    """Fastest predicted plan over every primary and every subset of remote nodes (small
    clusters only); no preference for fewer nodes. Same eligibility rules as plan_placement."""
    asked = request or PlacementRequest()
    _check_request(profile, asked)
    request = _search_request(asked)
    ready, degraded, notes = _select_nodes(cluster, request)
    for nodes, _ in _tiers(request, ready, degraded):
        if len(nodes) > max_nodes:
            raise ValueError(f"exhaustive search over {len(nodes)} nodes is too slow")
        ctx = _Ctx(profile, cluster, request, nodes, cost)
        try:
            best = _exhaustive_in(ctx, request)
            if best is not None:
                return _finish_plan(ctx, best, notes + ["exhaustive search"], asked)
        finally:
            ctx.release()
    raise PlacementRefused("no feasible plan (exhaustive search)", 0, ())


def _exhaustive_in(ctx: _Ctx, request: PlacementRequest) -> _Eval | None:
    """Every primary, every subset of the other nodes: the fastest feasible plan, or None."""
    best: _Eval | None = None
    for p in ctx.nodes:
        others = [n for n in ctx.nodes if n is not p]
        subsets: Iterable[tuple[_Node, ...]]
        if request.spread:
            subsets = [tuple(others)]
        else:
            subsets = itertools.chain.from_iterable(
                itertools.combinations(others, r) for r in range(len(others) + 1)
            )
        for sub in subsets:
            ev = _evaluate(ctx, p, sub, spread=request.spread)
            if not ev.feasible:
                continue
            if request.spread is False and len(ev.remote) != len(sub):
                continue  # a smaller subset covers this plan
            if best is None or ev.cost_s < best.cost_s:
                best = ev
    return best


def memory_proportional_plan(
    profile: ModelProfile,
    cluster: ClusterSnapshot,
    request: PlacementRequest | None = None,
    *,
    cost: CostModel = DEFAULT_COST,
) -> Plan:
    """The exo rule as a baseline: every eligible node, layers split by share of memory.

    The primary is the node with the most memory; each node's share goes to its devices by
    their free memory, clamped to what fits, so the baseline never runs out of memory either.
    """
    asked = request or PlacementRequest()
    _check_request(profile, asked)
    request = _search_request(asked)
    ready, degraded, notes = _select_nodes(cluster, request)
    nodes = ready or degraded
    ctx = _Ctx(profile, cluster, request, nodes, cost)
    try:
        return _memory_proportional_in(ctx, profile, notes, asked)
    finally:
        ctx.release()


def _memory_proportional_in(
    ctx: _Ctx, profile: ModelProfile, notes: list[str], asked: PlacementRequest
) -> Plan:
    prim = [n for n in ctx.nodes if n.primary_ok]
    if not prim:
        raise PlacementRefused("no node can be primary", 0, ())
    primary = max(prim, key=lambda n: (n.snap.free_bytes, n.snap.node_id))
    devs: list[_Dev] = []
    caps: dict[int, int] = {}
    # Remote devices first so the output lands on a remote device only when the primary has no
    # GPU (llama.cpp's order); the primary's GPUs hold the output otherwise.
    if primary.gpus:
        out: _Dev | None = max(primary.gpus, key=lambda g: g.snap.free_bytes)
    else:
        remote_devs = [d for n in ctx.nodes if n is not primary for d in n.devs]
        out = max(remote_devs, key=lambda d: d.snap.free_bytes) if remote_devs else None
    for n in ctx.nodes:
        for d in n.devs:
            if d is primary.cpu:
                c = primary.cap_alone if out is None else primary.cap_primary
            else:
                # Pipelined caps: the baseline may well offload everything to several devices.
                c = d.pcap_out if d is out else d.pcap
            if c > 0:
                devs.append(d)
                caps[id(d)] = c
    total_free = sum(d.snap.free_bytes for d in devs) or 1
    assign: dict[int, int] = {}
    placed = 0
    for d in devs:
        share = int(profile.n_layer * d.snap.free_bytes / total_free)
        c = min(caps[id(d)], share)
        assign[id(d)] = c
        placed += c
    # Hand the rounding remainder to the devices with the most spare room.
    for d in sorted(devs, key=lambda d: -(caps[id(d)] - assign[id(d)])):
        while placed < profile.n_layer and assign[id(d)] < caps[id(d)]:
            assign[id(d)] += 1
            placed += 1
    if placed < profile.n_layer:
        raise PlacementRefused("memory-proportional split does not fit", 0, ())
    if out is not None and assign.get(id(out), 0) == 0:
        raise PlacementRefused("memory-proportional split leaves the output device empty", 0, ())
    remote = []
    for n in ctx.nodes:
        if n is not primary and any(assign.get(id(d), 0) for d in n.devs):
            remote.append(n)
    if remote and out is None:
        raise PlacementRefused("memory-proportional split has no output device", 0, ())
    devmap = {id(d): d for d in devs}
    total = sum(c * devmap[k].t_tg for k, c in assign.items())
    total += (out or primary.cpu).out_tg  # type: ignore[union-attr]
    for n in remote:
        total += ctx.hop(primary, n, out is not None and out.node is n)
    offloaded = [k for k, c in assign.items() if c > 0 and devmap[k] is not primary.cpu]
    ev = _Eval(total, 0, primary, assign, devmap, out, remote)
    ev.pipeline = len(offloaded) > 1 and not assign.get(id(primary.cpu), 0)
    return _finish_plan(ctx, ev, notes + ["memory-proportional baseline (exo rule)"], asked)


# --- llama.cpp's own rule, for checking plans: agent/layers.py (the agent replays it too) ---
