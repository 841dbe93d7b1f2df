"""Reference solvers for tests and bench/scheduler.py, kept out of the hot path.

``exhaustive_best`` tries every primary and every subset (the optimum the search is measured
against); ``memory_proportional_plan`` is the exo rule, the baseline it must beat.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from apps.models_repo.profile import ModelProfile

from .assemble import _finish_plan
from .cost import DEFAULT_COST, CostModel
from .eligibility import _check_request, _search_request, _select_nodes, _tiers
from .evaluate import _Ctx, _Dev, _Eval, _evaluate, _Node
from .inputs import ClusterSnapshot, PlacementRequest
from .plan import PlacementRefused, Plan


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
    out_dev = out or primary.cpu
    if out_dev is None:  # no output device and no CPU: nothing can hold the output layer
        raise PlacementRefused("memory-proportional split has no output device", 0, ())
    total += out_dev.out_tg
    for n in remote:
        total += ctx.hop(primary, n, out is not None and out.node is n)
    offloaded = [k for k, c in assign.items() if c > 0 and devmap[k] is not primary.cpu]
    ev = _Eval(total, 0, primary, assign, devmap, out, remote)
    ev.pipeline = len(offloaded) > 1 and not assign.get(id(primary.cpu), 0)
    return _finish_plan(ctx, ev, notes + ["memory-proportional baseline (exo rule)"], asked)
