"""The owner's lending terms on the controller: the claim the agent reports, the owner's own
setting from the UI, pause and resume (a drain), and what the scheduler reads (open, closes in,
caps). Its own module next to services.py, enrollment.py, heartbeats.py and selectors.py: one
concern, and the policy logic itself is agent/lending.py (pure, shared with the agent).

An owner's policy (``node_lending_owner_set``) applies on the controller at once and is pushed to
the agent as a ``set_lending`` command on the node's own queue (the caller sends it: jobs owns
the queue); the agent checks it against its machine, applies it, keeps it across restarts, and
reports it back (LENDING_POLICY), which ``node_lending_claim`` records as adopted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from agent.lending import (
    LendingPolicy,
    PolicyError,
    check_caps,
    policy_from_document,
    policy_from_wire,
    window_state,
)
from racon.ids import NodeId

from .events import event_record
from .models import EventCategory, Node
from .services import DRAIN_BY_LENDING, node_drain, node_undrain

__all__ = [
    "LendingView",
    "PolicyError",
    "lending_view",
    "node_lending_claim",
    "node_lending_owner_set",
    "node_lending_paused",
    "node_lending_resumed",
]


def _validated(node: Node, policy: Any) -> LendingPolicy:
    parsed = policy_from_wire(policy if isinstance(policy, dict) else {})
    check_caps(parsed, node.hardware or {})
    return parsed


def node_lending_claim(*, node_id: NodeId, policy: Any, now: datetime) -> LendingPolicy:
    """The agent reported its policy (enrollment, HARDWARE_UPDATED, LENDING_POLICY): a claim,
    validated against the node's hardware. Raises PolicyError naming the field."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        parsed = _validated(node, policy)
        wire = parsed.to_wire()
        before = (node.lending or {}).get("policy")
        owner = (node.lending or {}).get("owner") or {}
        # The agent adopting the owner's policy (set_lending) reports it back: still the owner's.
        source = "owner" if owner.get("policy") == wire else "agent"
        node.lending = {**(node.lending or {}), "policy": wire, "source": source}
        if source == "owner":
            node.lending["owner"] = {**owner, "adopted_at": now.isoformat()}
        Node.objects.filter(pk=node_id).update(lending=node.lending)
        if before != wire and not (before is None and parsed.is_default):
            event_record(
                kind="LENDING_POLICY",
                category=EventCategory.MANAGEMENT,
                now=now,
                node_id=node_id,
                message="lending policy reported by the agent",
                data={"policy": wire},
            )
    return parsed


def node_lending_owner_set(
    *,
    node_id: NodeId,
    policy: Mapping[str, Any],
    now: datetime,
    by: str = "",
    push: Callable[[dict[str, Any]], Any] | None = None,
) -> LendingPolicy:
    """The owner set the policy (the UI's form): ``policy`` is a policy file's document
    (timezone, windows, handoff, idle.minutes/cpu_below, caps.ram_gb/vram_gb/threads), checked
    as the agent checks its own (agent/lending.py) and against the node's hardware. Stored and
    applied to planning at once; ``push(wire)`` runs after the commit to send it to the agent.
    Raises PolicyError naming the field; nothing is stored then."""
    parsed = policy_from_document(policy)
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        check_caps(parsed, node.hardware or {})
        wire = parsed.to_wire()
        owner = {"policy": wire, "at": now.isoformat(), "by": by[:150]}
        Node.objects.filter(pk=node_id).update(
            lending={**(node.lending or {}), "policy": wire, "source": "owner", "owner": owner}
        )
        event_record(
            kind="LENDING_POLICY",
            category=EventCategory.MANAGEMENT,
            now=now,
            node_id=node_id,
            message=f"lending policy set by the owner{f' ({by})' if by else ''}",
            data={"policy": wire, "by": by},
        )
        if push is not None:
            transaction.on_commit(lambda: push(wire))
    return parsed


def node_lending_paused(*, node_id: NodeId, handoff: str, reason: str, now: datetime) -> Node:
    """The agent paused lending (``node-agent pause`` or its window closed): DRAINING at once,
    through the drain's planned handoff; with ``failover`` the agent hands its running jobs over.
    The drain is recorded as the pause's own, unless an operator's drain is already in force."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        paused = {"handoff": handoff, "reason": reason[:200], "at": now.isoformat()}
        Node.objects.filter(pk=node_id).update(lending={**(node.lending or {}), "paused": paused})
    return node_drain(node_id=node_id, now=now, by=DRAIN_BY_LENDING)


def node_lending_resumed(*, node_id: NodeId, now: datetime) -> Node:
    """Lending resumed: a drain that the pause began is lifted. An operator's stays, whether it
    came before the pause or during it (``drain_requested_by``, apps/nodes/services.py): a node
    cannot undo an operator's drain by pausing and resuming (issue 28)."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        lending = dict(node.lending or {})
        lending.pop("paused", None)
        Node.objects.filter(pk=node_id).update(lending=lending)
        # Under the row lock: an operator's drain arriving now waits, and then stays.
        if node.drain_requested and node.drain_requested_by == DRAIN_BY_LENDING:
            return node_undrain(node_id=node_id, now=now)
    return Node.objects.get(pk=node_id)


@dataclass(frozen=True)
class LendingView:
    """What the scheduler reads: whether the window is open, seconds until it closes (None:
    never), and the caps (None: no cap)."""

    open: bool = True
    closes_in: float | None = None
    ram_bytes: int | None = None
    vram_bytes: int | None = None
    threads: int | None = None
    paused: bool = False


def lending_view(*, lending: dict[str, Any] | None, now: datetime) -> LendingView:
    """A node's stored lending terms at ``now`` (a stored policy that no longer parses is read
    as no policy: it was valid when stored)."""
    raw = (lending or {}).get("policy")
    paused = bool((lending or {}).get("paused"))
    if not raw:
        return LendingView(paused=paused)
    try:
        policy = policy_from_wire(raw)
    except PolicyError:
        return LendingView(paused=paused)
    is_open, closes_in = window_state(policy, now)
    return LendingView(
        open=is_open,
        closes_in=closes_in,
        ram_bytes=policy.caps.ram_bytes,
        vram_bytes=policy.caps.vram_bytes,
        threads=policy.caps.threads,
        paused=paused,
    )
