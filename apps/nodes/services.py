"""Writes for the node registry's states: the one guarded transition, the node cache, faults,
the health sweep and drain. Enrollment is enrollment.py, heartbeats heartbeats.py; both import
from here, never the reverse.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from agent.protocol import HEARTBEATS_ZSET
from racon import ids
from racon.broadcast import broadcast
from racon.celery import task_send
from racon.ids import NodeId
from racon.redis import get_redis
from racon.transitions import transition_guarded

from . import hooks
from .events import event_record
from .models import EventCategory, Node
from .states import (
    DEPLOYMENT_SIGNALS,
    DRAIN_STATES,
    DRAINABLE,
    HEALTH_WATCHED,
    ONLINE,
    TRANSITIONS,
    NodeState,
    health_state,
)

log = logging.getLogger("racon.nodes")
S = NodeState
# BUSY ⇄ READY moves, counted (racon_node_busy_flips in /metrics): a node can flip on every
# heartbeat by toggling telemetry.jobs, so a flip writes no event row and queues no task (issue 28).
BUSY_FLIPS_KEY = "racon:metrics:node_busy_flips"


def _flip(src: str, to: str) -> bool:
    return src in ONLINE and to in ONLINE


def _meta_key(node_id: NodeId) -> str:
    return f"racon:node:{node_id}:meta"


def _stored_hash(node: Node) -> str:
    """What a credential is checked against: its hash, "" once the node is revoked."""
    return "" if node.revoked_at is not None else node.credential_hash


def _cache_node(node: Node) -> None:
    """Mirror what a heartbeat needs (credential hash, state, drain request) into Redis."""
    get_redis().hset(
        _meta_key(ids.node_id(node.id)),
        mapping={
            "cred": _stored_hash(node),
            "state": node.state,
            "drain": int(node.drain_requested),
        },
    )


# --- transitions ------------------------------------------------------------------------------


def node_transition(
    *,
    node_id: NodeId,
    to: str,
    now: datetime,
    expected: str | Collection[str] | None = None,
    kind: str = "NODE_STATE_CHANGED",
    category: str = EventCategory.LIFECYCLE,
    message: str = "",
    data: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> bool:
    """Move a node to ``to`` if the table allows it and its state is still ``expected``.

    A guarded update (racon.transitions): a stale or duplicate message finds the state already
    changed and is a no-op. Writes the event in the same transaction and broadcasts after commit;
    a BUSY ⇄ READY flip is counted instead of written, and sends the apps above nothing.
    ``expected`` may be a named group (states.py). Returns whether it moved.
    """

    def record(src: str) -> None:
        if _flip(src, to):
            get_redis().incr(BUSY_FLIPS_KEY)
            return
        event_record(
            kind=kind,
            category=category,
            now=now,
            node_id=node_id,
            old_state=src,
            new_state=to,
            message=message or f"{src} → {to}",
            data=data,
        )

    moved = transition_guarded(
        model=Node,
        pk=node_id,
        to=to,
        table=TRANSITIONS,
        expected=expected,
        fields={"state_changed_at": now, **(extra or {})},
        record=record,
        after_commit=lambda src: _after_transition(node_id, src, to),
        must_exist=True,
        log=log,
    )
    if moved is None:
        return False
    # Mirror now as well as after commit: a heartbeat must see the new state at once. If an outer
    # transaction rolls back, the heartbeat's guarded update fails and re-reads the database.
    _refresh_cache(node_id)
    return True


def _refresh_cache(node_id: NodeId) -> None:
    node = Node.objects.filter(pk=node_id).first()
    if node is not None:
        _cache_node(node)


def _after_transition(node_id: NodeId, src: str, to: str) -> None:
    broadcast("nodes.dashboard", {"type": "node.changed", "node_id": str(node_id), "state": to})
    hooks.node_state_moved.send(sender=Node, node_id=str(node_id), old=src, new=to)
    if _flip(src, to):
        return  # no work for a flip: its deployments' health did not change
    # Back online straight into BUSY is an arrival as well (a degraded deployment is restored).
    signal = S.READY if to in ONLINE else to
    if signal in DEPLOYMENT_SIGNALS:
        task_send(
            "racon.jobs.node_state_changed", node_id=str(node_id), state=signal
        )  # jobs' task, by name


def node_report_fault(*, node_id: NodeId, fatal: bool, message: str, now: datetime) -> None:
    """An agent reported a fault: fatal → ERROR, otherwise DEGRADED (fallback only)."""
    target = S.ERROR if fatal else S.DEGRADED
    node_transition(
        node_id=node_id,
        to=target,
        now=now,
        kind="NODE_FAULT",
        category=EventCategory.HEALTH,
        message=message[:500],
    )


# --- health sweep ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepResult:
    degraded: list[str]
    offline: list[str]
    suppressed: list[str]


def node_health_sweep(*, now: datetime) -> SweepResult:
    """Apply the heartbeat thresholds; guard against marking most of the cluster OFFLINE at once."""
    interval = settings.HEARTBEAT_INTERVAL
    watched = list(
        Node.objects.filter(state__in=HEALTH_WATCHED, revoked_at__isnull=True).values_list(
            "id", "state"
        )
    )
    if not watched:
        return SweepResult([], [], [])
    ids = [str(n[0]) for n in watched]
    r = get_redis()
    scores = r.zmscore(HEARTBEATS_ZSET, ids)
    lost: dict[str | bytes, float] = {
        i: now.timestamp() for i, score in zip(ids, scores, strict=True) if score is None
    }
    if lost:
        # Redis lost these nodes' heartbeat times (a restart without persistence, a flush): a
        # watched node had one, since only a heartbeat brings a node online. The database's time
        # of its last state change is no heartbeat: judged by it, a node READY for a minute went
        # OFFLINE at once, and its deployments were failed, before its next beat a second later.
        # Its clock starts now (NX: a beat that landed meanwhile stays); a silent node still goes
        # DEGRADED, then OFFLINE, on the usual thresholds from here.
        r.zadd(HEARTBEATS_ZSET, lost, nx=True)
        scores = [lost.get(i, score) for i, score in zip(ids, scores, strict=True)]
    to_degrade: list[tuple[str, str, float]] = []
    to_offline: list[tuple[str, str, float]] = []
    live_count = 0
    for (pk, state), score in zip(watched, scores, strict=True):
        if state != S.DEGRADED:
            live_count += 1
        age = max(0.0, now.timestamp() - float(score))
        verdict = health_state(
            age=age,
            interval=interval,
            degraded_after=settings.HEARTBEAT_DEGRADED_AFTER,
            offline_after=settings.HEARTBEAT_OFFLINE_AFTER,
        )
        if verdict == S.OFFLINE:
            to_offline.append((str(pk), state, age))
        elif verdict == S.DEGRADED and state != S.DEGRADED:
            to_degrade.append((str(pk), state, age))
    suppressed: list[str] = []
    total = len(watched)
    if (
        len(to_offline) >= settings.MASS_FAILURE_MIN_NODES
        and len(to_offline) >= settings.MASS_FAILURE_FRACTION * total
    ):
        # Most of the cluster went silent in one sweep: far likelier a controller-side network
        # fault than that many machines failing together. Raise one event, keep them DEGRADED.
        suppressed = [n for n, _, _ in to_offline]
        if r.set(
            "racon:cluster:partition", now.timestamp(), nx=True, ex=int(max(60, interval * 12))
        ):
            event_record(
                kind="CLUSTER_PARTITION_SUSPECTED",
                category=EventCategory.HEALTH,
                now=now,
                message=f"{len(suppressed)} of {total} nodes went silent in one sweep; not marking them OFFLINE",
                data={"nodes": suppressed},
            )
        to_degrade.extend((n, st, age) for n, st, age in to_offline if st != S.DEGRADED)
        to_offline = []
    degraded: list[str] = []
    offline: list[str] = []
    for node_id, state, age in to_degrade:
        if node_transition(
            node_id=NodeId(node_id),
            to=S.DEGRADED,
            expected=state,
            now=now,
            kind="HEARTBEAT_TIMEOUT",
            category=EventCategory.HEALTH,
            message=f"heartbeat late by {age:.1f}s",
            data={"age": round(age, 3)},
        ):
            degraded.append(node_id)
    for node_id, state, age in to_offline:
        if node_transition(
            node_id=NodeId(node_id),
            to=S.OFFLINE,
            expected=state,
            now=now,
            kind="HEARTBEAT_TIMEOUT",
            category=EventCategory.HEALTH,
            message=f"no heartbeat for {age:.1f}s",
            data={"age": round(age, 3)},
        ):
            offline.append(node_id)
    return SweepResult(degraded, offline, suppressed)


# --- drain -------------------------------------------------------------------------------------
#
# DRAINING (operator) → the apps above move their work off (jobs: a replacement deployment on
# other nodes, the old one stopped once the new one is READY and its own jobs have ended, or at
# the end when no capacity exists) → DRAINED with NODE_DRAINED, once nothing of theirs is left.
# drain_requested outlives an OFFLINE spell: the next heartbeat drains the node again.


DRAIN_BY_OPERATOR = "operator"
DRAIN_BY_LENDING = "lending"  # the agent's own pause (apps/nodes/lending.py)


def node_drain(*, node_id: NodeId, now: datetime, by: str = DRAIN_BY_OPERATOR) -> Node:
    """Stop assigning new work to the node; its work moves or finishes, then it is DRAINED.

    ``by`` records who asked: an operator's drain is never turned into a lending one, and an
    operator draining a paused node takes the drain over (the agent's resume then leaves it)."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        if node.drain_requested and node.drain_requested_by == DRAIN_BY_OPERATOR:
            by = DRAIN_BY_OPERATOR
        Node.objects.filter(pk=node_id).update(drain_requested=True, drain_requested_by=by)
        # A heartbeat may move BUSY ⇄ READY between our read and the guarded update: re-read and retry.
        for _ in range(3):
            state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
            if state not in DRAINABLE:
                break
            if node_transition(
                node_id=node_id,
                to=S.DRAINING,
                expected=state,
                now=now,
                kind="NODE_DRAIN_REQUESTED",
                category=EventCategory.MANAGEMENT,
                message="drain requested",
            ):
                break
    node.refresh_from_db()
    _cache_node(node)
    node_drain_advance(node_id=node_id, now=now)
    node.refresh_from_db()
    return node


def node_drain_advance(*, node_id: NodeId, now: datetime) -> bool:
    """One step of a drain: the apps above move or stop their work; DRAINED once none is left.

    Idempotent, and run from several places (the drain request, a job's end, a replacement
    becoming READY, the node's heartbeat); NODE_DRAINED is written by the one guarded
    DRAINING → DRAINED transition, so once. Returns whether the node is DRAINED now.
    """
    if Node.objects.filter(pk=node_id).values_list("state", flat=True).first() != S.DRAINING:
        return False
    if hooks.node_drain_step(node_id=node_id, now=now):
        return False
    return node_transition(
        node_id=node_id,
        to=S.DRAINED,
        expected=S.DRAINING,
        now=now,
        kind="NODE_DRAINED",
        category=EventCategory.MANAGEMENT,
        message="node drained: its deployments moved or stopped, and its last job has ended",
    )


def node_undrain(*, node_id: NodeId, now: datetime) -> Node:
    """Accept new work again."""
    with transaction.atomic():
        Node.objects.filter(pk=node_id).update(drain_requested=False, drain_requested_by="")
        state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
        if state in DRAIN_STATES:
            node_transition(
                node_id=node_id,
                to=S.READY,
                expected=state,
                now=now,
                kind="NODE_UNDRAINED",
                category=EventCategory.MANAGEMENT,
                message="drain lifted",
            )
    node = Node.objects.get(pk=node_id)
    _cache_node(node)
    return node
