"""Node states and the one table of allowed transitions. Pure: no ORM."""

from __future__ import annotations

from django.db import models


class NodeState(models.TextChoices):
    """Owners of each arrow: the agent (handshake, READY, fatal faults), the health sweep
    (DEGRADED, OFFLINE), the heartbeat (recovery, BUSY ⇄ READY) and the operator (drain)."""

    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"
    BUSY = "BUSY"
    DRAINING = "DRAINING"
    DEGRADED = "DEGRADED"
    OFFLINE = "OFFLINE"
    ERROR = "ERROR"


S = NodeState

TRANSITIONS: dict[str, frozenset[str]] = {
    S.UNINITIALIZED: frozenset({S.REGISTERING, S.OFFLINE, S.ERROR}),
    S.REGISTERING: frozenset({S.READY, S.DEGRADED, S.OFFLINE, S.ERROR, S.DRAINING}),
    S.READY: frozenset({S.BUSY, S.DRAINING, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.BUSY: frozenset({S.READY, S.DRAINING, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.DRAINING: frozenset({S.READY, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.DEGRADED: frozenset({S.READY, S.BUSY, S.DRAINING, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.OFFLINE: frozenset({S.READY, S.BUSY, S.DRAINING, S.DEGRADED, S.ERROR, S.REGISTERING}),
    # ERROR is unrecoverable for the running agent: only a new handshake (restart) leaves it.
    S.ERROR: frozenset({S.REGISTERING, S.OFFLINE}),
}

# Scheduler eligibility for new placements. DEGRADED is a fallback only.
SCHEDULABLE = frozenset({S.READY})
FALLBACK = frozenset({S.DEGRADED})
# States the health sweep watches for late heartbeats.
LIVE = frozenset({S.READY, S.BUSY, S.DRAINING, S.REGISTERING})


def can_transition(src: str, dst: str) -> bool:
    return dst in TRANSITIONS.get(src, frozenset())


def health_state(*, age: float, interval: float, degraded_after: float, offline_after: float) -> str | None:
    """What a heartbeat this many seconds old means: None (healthy), DEGRADED or OFFLINE."""
    if age >= offline_after * interval:
        return S.OFFLINE
    if age >= degraded_after * interval:
        return S.DEGRADED
    return None
