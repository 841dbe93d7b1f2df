"""The search's model of a cluster for one decision, and the evaluation of one candidate set.

The hot path: ``_Ctx`` precomputes every figure once per decision, ``_evaluate`` scores a
primary plus remote nodes thousands of times per decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from apps.models_repo.profile import ModelProfile

from .cost import CostModel, compute_buffer_bytes, hop_s, host_buffer_bytes, kv_bytes_per_layer
from .inputs import ClusterSnapshot, DeviceSnapshot, NodeSnapshot, PlacementRequest

# Infeasible candidates still get a cost so the greedy search is pulled towards capacity first.
_UNPLACED_LAYER_PENALTY_S = 1e6


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
                node.primary_ok = ns.may_be_primary
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
