"""Which nodes a request may use (pins, exclusions, one replica per node, node states)."""

from __future__ import annotations

import dataclasses

from apps.models_repo.profile import ModelProfile
from apps.nodes.states import FALLBACK, PLACEABLE, SCHEDULABLE
from racon.ids import NodeId

from .inputs import ClusterSnapshot, DeviceSnapshot, NodeSnapshot, PlacementRequest
from .plan import PlacementRefused


def _select_nodes(
    cluster: ClusterSnapshot, request: PlacementRequest
) -> tuple[list[NodeSnapshot], list[NodeSnapshot], list[str]]:
    """(ready nodes, degraded fallbacks, explanation lines) after pins, exclusions and states."""
    by_id: dict[str, NodeSnapshot] = {n.node_id: n for n in cluster.nodes}
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
        closed = [n for n in candidates if not n.window_open]
        if closed:
            raise PlacementRefused(
                "pinned nodes are outside their lending window: "
                + ", ".join(n.name or n.node_id for n in closed),
                0,
                (),
            )
        bad = [n for n in candidates if n.state not in PLACEABLE]
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
    closed = [n for n in candidates if not n.window_open]
    if closed:
        candidates = [n for n in candidates if n.window_open]
        notes.append("outside their lending window: " + _names(closed))
    ready = [n for n in candidates if n.state in SCHEDULABLE]
    degraded = [n for n in candidates if n.state in FALLBACK]
    ending = [
        n
        for n in ready
        if n.window_closes_in is not None and n.window_closes_in < cluster.min_window_seconds
    ]
    if ending:
        ready = [n for n in ready if n not in ending]
        degraded = ending + degraded
        notes.append(
            f"lending window closes within {cluster.min_window_seconds:.0f}s, avoided for "
            "long-lived deployments (a fallback only): " + _names(ending)
        )
    skipped = [n for n in candidates if n.state not in PLACEABLE]
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


def _names(nodes: list[NodeSnapshot]) -> str:
    names = [n.name or n.node_id for n in nodes]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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


def _search_request(asked: PlacementRequest) -> PlacementRequest:
    """The request the search runs with: one slot when the slots are left to memory."""
    return dataclasses.replace(asked, n_parallel=1) if asked.n_parallel is None else asked


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


# An unpinned CPU on a node whose GPU is pinned: this much slower, so the fastest-first fill puts
# the layers on the pinned devices and the CPU keeps only what llama.cpp always keeps there.
_UNPINNED_CPU_SLOWDOWN = 1e-6


def pin_devices_apply(
    cluster: ClusterSnapshot, request: PlacementRequest
) -> tuple[ClusterSnapshot, PlacementRequest]:
    """The cluster and request a device pin leaves: only the named devices' nodes (pinned, and
    spread over when several), on each only its named devices (its CPU kept, since llama.cpp
    always holds the embeddings and host buffers there, but planned on only when named)."""
    if not request.pin_devices:
        return cluster, request
    by_key = {}
    for n in cluster.nodes:
        by_key[n.node_id] = n
        if n.name:
            by_key.setdefault(NodeId(n.name), n)
    wanted: dict[str, set[str]] = {}
    for entry in request.pin_devices:
        node_part, sep, dev = str(entry).rpartition(":")
        if sep:
            node = by_key.get(NodeId(node_part))
            if node is None:
                raise PlacementRefused(
                    f"device pin {entry!r}: no node {node_part!r}", 0, (), code="invalid_request"
                )
            nodes = [node]
        else:
            nodes = [n for n in cluster.nodes if any(d.device == dev for d in n.devices)]
        found = [n for n in nodes if any(d.device == dev for d in n.devices)]
        if not found:
            raise PlacementRefused(
                f"device pin {entry!r}: no such device"
                + (f" on {nodes[0].name or nodes[0].node_id}" if sep else " on any node")
                + " (names as llama.cpp gives them: CPU, CUDA0, Vulkan0, ...)",
                0,
                (),
                code="invalid_request",
            )
        for n in found:
            wanted.setdefault(n.node_id, set()).add(dev)
    nodes = []
    for n in cluster.nodes:
        if n.node_id not in wanted:
            continue
        devs: list[DeviceSnapshot] = []
        for d in n.devices:
            if d.device in wanted[n.node_id]:
                devs.append(d)
            elif d.kind == "cpu":
                devs.append(
                    dataclasses.replace(
                        d,
                        gflops=d.gflops * _UNPINNED_CPU_SLOWDOWN,
                        mem_bandwidth_gbps=d.mem_bandwidth_gbps * _UNPINNED_CPU_SLOWDOWN,
                    )
                )
        # The operator chose this one node's devices: an unverified GPU's node may then be the
        # primary. With several nodes pinned there is a choice, and the verified one keeps it.
        alone = len(wanted) == 1
        nodes.append(
            dataclasses.replace(n, devices=tuple(devs), may_be_primary=n.may_be_primary or alone)
        )
    pinned = tuple(n.node_id for n in nodes)
    request = dataclasses.replace(
        request,
        pin_nodes=pinned,
        spread=request.spread or len(pinned) > 1,
        exclude_nodes=tuple(x for x in request.exclude_nodes if x not in pinned),
    )
    return dataclasses.replace(cluster, nodes=tuple(nodes)), request


def unverified_primary_fallback(cluster: ClusterSnapshot) -> ClusterSnapshot:
    """A node with an unverified GPU claim is never the primary while another node can be; when
    none can (a one-machine pool with a GPU), it may, or nothing could be placed at all."""
    if any(n.may_be_primary for n in cluster.nodes):
        return cluster
    return dataclasses.replace(
        cluster, nodes=tuple(dataclasses.replace(n, may_be_primary=True) for n in cluster.nodes)
    )


def pin_primary_apply(cluster: ClusterSnapshot, request: PlacementRequest) -> ClusterSnapshot:
    """The operator's pinned primary is the only node that may be the primary; a primary that is
    excluded, or outside the pinned nodes, is refused naming why."""
    if request.primary is None:
        return cluster
    if request.primary in request.exclude_nodes:
        raise PlacementRefused(
            f"the pinned primary {request.primary} is also excluded", 0, (), code="invalid_request"
        )
    if request.pin_nodes is not None and request.primary not in request.pin_nodes:
        raise PlacementRefused(
            f"the pinned primary {request.primary} is not one of the pinned nodes",
            0,
            (),
            code="invalid_request",
        )
    if not any(n.node_id == request.primary for n in cluster.nodes):
        raise PlacementRefused(f"unknown primary node: {request.primary}", 0, ())
    return dataclasses.replace(
        cluster,
        nodes=tuple(
            dataclasses.replace(n, may_be_primary=n.node_id == request.primary)
            for n in cluster.nodes
        ),
    )
