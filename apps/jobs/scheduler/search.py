"""The placement search: plan_placement, the one entry point of the hot path."""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
import math
from collections.abc import Iterable, Sequence

from apps.models_repo.profile import ModelProfile

from .assemble import _finish_plan
from .cost import DEFAULT_COST, CostModel
from .eligibility import (
    _check_request,
    _search_request,
    _select_nodes,
    _tiers,
    pin_devices_apply,
    pin_primary_apply,
    unverified_primary_fallback,
)
from .evaluate import _Ctx, _Eval, _evaluate, _Node
from .inputs import ClusterSnapshot, NodeSnapshot, PlacementRequest
from .plan import PlacementRefused, Plan, PlanDevice, fmt_bytes

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


def reaches(primary: NodeSnapshot, worker: NodeSnapshot) -> bool:
    """Whether the primary can reach the worker's advertised address at all: a node that
    advertises loopback (a loopback-only `make run`'s own) serves only primaries that advertise
    loopback too, i.e. on its own machine; a primary elsewhere would dial its own loopback."""
    try:
        worker_lo = ipaddress.ip_address(worker.address.strip("[]")).is_loopback
        primary_lo = ipaddress.ip_address(primary.address.strip("[]")).is_loopback
    except ValueError:
        return True  # a name: the links' probes judge it
    return primary_lo or not worker_lo


def _remote_pool(ctx: _Ctx, primary: _Node, nodes: Sequence[_Node], size: int) -> list[_Node]:
    """Remote nodes worth trying with this primary: cheapest per layer once the hop is shared.

    Ranked first with the default link (one ranking per decision), then the head of that
    ranking is re-scored with this primary's probed links: O(size) per primary, not O(nodes).
    """
    n_layer = ctx.n_layer
    ranking = ctx.remote_ranking()
    head: list[_Node] = []
    for node in ranking:
        if node is not primary and reaches(primary.snap, node.snap):
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
            if node is primary or id(node) in chosen or not reaches(primary.snap, node.snap):
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
    cluster, pinned = pin_devices_apply(cluster, asked)
    cluster = unverified_primary_fallback(cluster)
    cluster = pin_primary_apply(cluster, asked)
    request = _search_request(pinned)
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
