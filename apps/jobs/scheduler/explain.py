"""The plan's explanation: why these nodes and devices, and why the others were left out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from racon.ids import NodeId

from .plan import PlanDevice, fmt_bytes

if TYPE_CHECKING:
    from .evaluate import _Ctx, _Eval


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
                slow = _slower_link(ctx, ev, n.snap.node_id, used)
                if n.total_cap <= 0:
                    why = "too little free memory for even one layer"
                elif slow:
                    why = slow
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


def _slower_link(ctx: _Ctx, ev: _Eval, node_id: NodeId, used: set[NodeId]) -> str | None:
    """Name a left-out node's measured link to the primary when it is worse than every link the
    plan uses (multi-host issue: a node behind a slow connection is avoided, and the plan says so)."""
    primary = ev.primary.snap
    links = ctx.cluster.links
    mine = links.get((primary.node_id, node_id)) or links.get((node_id, primary.node_id))
    if mine is None:
        return None
    in_use = [ctx.cluster.link(primary.node_id, u) for u in used if u != primary.node_id]
    # A one-node plan uses no link: compare with the primary's other measured links instead.
    others = [n.snap.node_id for n in ctx.nodes if n.snap.node_id not in (primary.node_id, node_id)]
    reference = in_use or [
        lk
        for o in others
        if (lk := links.get((primary.node_id, o)) or links.get((o, primary.node_id))) is not None
    ]
    if not reference or any(
        lk.rtt_ms >= mine.rtt_ms and lk.bandwidth_mbps <= mine.bandwidth_mbps for lk in reference
    ):
        return None
    return (
        f"slow link to {primary.name or primary.node_id}: {mine.rtt_ms:.1f} ms round trip, "
        f"{mine.bandwidth_mbps:.1f} Mbit/s"
    )
