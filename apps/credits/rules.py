"""The earn and spend rules as pure integer arithmetic: no ORM, no settings, no clock.

Everything is in micro-credits and integer division; callers pass the settings in. Rounding is
never lost: whatever integer division leaves over goes to a named party (the primary node), so
the parts of a split always add up to exactly the whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# Amounts past this are refused: two of them still add up inside a signed 64-bit column.
MAX_AMOUNT = 2**62
GIB = 1024**3
MS_PER_HOUR = 3_600_000
PPM = 1_000_000


def amount_check(amount: Any, *, what: str = "amount", allow_negative: bool = False) -> int:
    """``amount`` as an int, or ValueError when it is not an integer, zero, out of range or negative."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ValueError(f"{what} must be an integer number of micro-credits, got {amount!r}")
    if amount == 0:
        raise ValueError(f"{what} must not be zero")
    if amount < 0 and not allow_negative:
        raise ValueError(f"{what} must be positive, got {amount}")
    if abs(amount) > MAX_AMOUNT:
        raise ValueError(f"{what} {amount} overflows (limit ±2^62 micro-credits)")
    return amount


def token_cost(*, tokens: int, price_permille: int, micro_per_token: int) -> int:
    """What ``tokens`` tokens cost: tokens × base rate × model weight / 1000, rounded up."""
    if tokens < 0 or price_permille < 0 or micro_per_token < 0:
        raise ValueError("tokens, price weight and base rate must not be negative")
    return -(-tokens * micro_per_token * price_permille // 1000)


@dataclass(frozen=True)
class NodeWork:
    """One node's part in a job: the layers it held and, if the runtime measured it, its compute time."""

    node_id: str
    layers: int
    device_ms: int | None = None


def plan_work(
    plan: Mapping[str, Any], device_seconds: Mapping[str, Any] | None
) -> tuple[str | None, list[NodeWork]]:
    """The primary and per-node work of a deployment plan (Plan.to_dict()), in plan order."""
    layers: dict[str, int] = {}
    for d in plan.get("devices") or []:
        node_id = str(d.get("node_id") or "")
        if not node_id:
            continue
        n = max(int(d.get("layer_end") or 0) - int(d.get("layer_start") or 0), 0)
        layers[node_id] = layers.get(node_id, 0) + n
    primary = plan.get("primary_node_id")
    primary = str(primary) if primary else None
    if primary is not None and primary not in layers:
        layers[primary] = 0  # the primary coordinates even when it holds no repeating layers
    measured: dict[str, int] = {}
    for node_id, seconds in (device_seconds or {}).items():
        try:
            ms = round(float(seconds) * 1000)
        except (TypeError, ValueError):
            continue
        if ms > 0:
            measured[str(node_id)] = ms
    return primary, [
        NodeWork(node_id=n, layers=layers[n], device_ms=measured.get(n)) for n in layers
    ]


def device_seconds_clamped(
    device_seconds: Mapping[str, Any] | None, *, plan: Mapping[str, Any], wall_seconds: float
) -> dict[str, float]:
    """A primary's device_seconds claim, each node's figure at most the attempt's wall time (as
    the controller saw it, dispatch to finish) × the node's devices in the plan, and every other
    node's at least the primary's own figure per device.

    The figures weigh the split between the primary and its RPC workers, and the primary reports
    them all: unbounded, ``{self: 1e9}`` would leave the workers almost nothing. No device can have
    computed longer than the attempt ran (the bound from above). From below, the controller cannot
    see a worker's device, so the primary's word that a worker computed less than it did itself
    (``{self: wall, worker: 0.001}``) is not taken: a primary's figures can move pay towards its
    workers, never towards itself. A worker it did not report gets the same floor. Nodes outside
    the plan and figures that are not positive numbers are dropped.
    """
    devices: dict[str, int] = {}
    for d in plan.get("devices") or []:
        node_id = str(d.get("node_id") or "")
        if node_id:
            devices[node_id] = devices.get(node_id, 0) + 1
    primary = str(plan.get("primary_node_id") or "")
    if primary and primary not in devices:
        devices[primary] = 1
    wall = max(float(wall_seconds), 0.0)
    out: dict[str, float] = {}
    for node_id, seconds in (device_seconds or {}).items():
        n = devices.get(str(node_id))
        if n is None:
            continue
        try:
            value = float(seconds)
        except (TypeError, ValueError):
            continue
        if value != value or value <= 0:  # NaN or nothing measured
            continue
        out[str(node_id)] = min(value, wall * n)
    own = out.get(primary)
    if own is not None and primary in devices:
        per_device = own / devices[primary]
        for node_id, n in devices.items():
            if node_id != primary:
                out[node_id] = max(out.get(node_id, 0.0), per_device * n)
    return out


def settlement_split(
    *,
    value: int,
    work: Sequence[NodeWork],
    primary_node_id: str | None,
    tokens: int,
    primary_share_permille: int,
) -> dict[str, int]:
    """Split ``value`` across nodes: ∝ layers × tokens × measured time, a primary bonus, exact sum.

    - The primary first takes ``primary_share_permille`` of the value for coordinating.
    - The rest goes by weight layers × tokens × t, where t is the node's measured compute time
      (job.device_seconds) and, for a node the runtime did not measure, the mean of the measured
      ones (1 for all when none was measured, so the split is by layers alone).
    - The remainder of integer division goes to the primary, so the parts sum to ``value``.
    """
    if value < 0:
        raise ValueError("value must not be negative")
    if not work:
        return {}
    ids = [w.node_id for w in work]
    if len(set(ids)) != len(ids):
        raise ValueError("each node appears once in the work list")
    primary = primary_node_id if primary_node_id in ids else ids[0]
    permille = min(max(primary_share_permille, 0), 1000)
    bonus = value * permille // 1000
    rest = value - bonus
    measured = [w.device_ms for w in work if w.device_ms]
    default_ms = sum(measured) // len(measured) if measured else 1
    weights = {
        w.node_id: max(w.layers, 0) * max(tokens, 0) * (w.device_ms or default_ms or 1)
        for w in work
    }
    total = sum(weights.values())
    shares = {n: (rest * weights[n] // total if total else 0) for n in ids}
    shares[primary] += value - sum(
        shares.values()
    )  # bonus + rounding remainder (+ all when no weight)
    return shares


def share_ppm(part: int, whole: int) -> int:
    """``part`` of ``whole`` in parts per million (0 when there is no whole)."""
    return part * PPM // whole if whole > 0 else 0


def standby_amount(*, per_gib_hour: int, memory_bytes: int, elapsed_ms: int) -> int:
    """Standby pay: rate × GiB offered × hours lent, rounded down."""
    if per_gib_hour <= 0 or memory_bytes <= 0 or elapsed_ms <= 0:
        return 0
    return per_gib_hour * memory_bytes * elapsed_ms // (GIB * MS_PER_HOUR)


def standby_memory(*, claimed_bytes: int, seen_bytes: int, unseen_allowance: int) -> int:
    """Memory standby pays for: what the node claims free, but beyond ``unseen_allowance`` only as
    much as it was seen to hold (buffers another node's primary loaded onto it). A negative
    allowance turns the rule off."""
    claimed = max(claimed_bytes, 0)
    if unseen_allowance < 0:
        return claimed
    return min(claimed, max(seen_bytes, 0, unseen_allowance))


def standby_capped(amount: int, *, cap: int) -> int:
    """Standby pay for one node and period, at most ``cap`` (0 or less: no cap)."""
    return amount if cap <= 0 else min(amount, cap)


MIB = 1024**2


def seen_worker_bytes(*, plan: Mapping[str, Any], load_report: Mapping[str, Any]) -> dict[str, int]:
    """Node → bytes of model, KV and compute buffers a primary reported loading onto that node's
    RPC devices (the load report's assignment, matched to the plan by endpoint). The primary's
    own devices are left out: a node cannot vouch for itself."""
    primary = str(plan.get("primary_node_id") or "")
    by_endpoint: dict[str, str] = {}
    for d in plan.get("devices") or []:
        node_id, endpoint = str(d.get("node_id") or ""), d.get("endpoint")
        if node_id and endpoint and node_id != primary:
            by_endpoint[str(endpoint)] = node_id
    seen: dict[str, int] = {}
    for entry in load_report.get("assignment") or []:
        if not isinstance(entry, Mapping):
            continue
        worker = by_endpoint.get(str(entry.get("endpoint") or ""))
        if worker is None:
            continue
        mib = 0.0
        for key in ("model_buffer_mib", "kv_buffer_mib", "compute_buffer_mib"):
            try:
                mib += max(float(entry.get(key) or 0.0), 0.0)
            except (TypeError, ValueError):
                continue
        seen[worker] = seen.get(worker, 0) + int(mib * MIB)
    return seen


def job_priority_order(
    jobs: Iterable[tuple[Hashable, int, datetime]], now: datetime, max_wait_s: float
) -> list[Hashable]:
    """Job ids in serving order: by standing then arrival; a job that waited max_wait_s goes first.

    Starvation is bounded: once a job has waited ``max_wait_s`` it is ahead of every job that has
    not, whatever the standings, and overdue jobs among themselves are served oldest first.
    """
    overdue: list[tuple[datetime, str, Hashable]] = []
    waiting: list[tuple[int, datetime, str, Hashable]] = []
    for job_id, standing, queued_at in jobs:
        if (now - queued_at).total_seconds() >= max_wait_s:
            overdue.append((queued_at, str(job_id), job_id))
        else:
            waiting.append((-int(standing), queued_at, str(job_id), job_id))
    overdue.sort(key=lambda t: t[:2])
    waiting.sort(key=lambda t: t[:3])
    return [t[-1] for t in overdue] + [t[-1] for t in waiting]
