"""Node states and the one table of allowed transitions. Pure: no ORM."""

from __future__ import annotations

from django.db import models


class NodeState(models.TextChoices):
    """Owners of each arrow: the agent (handshake, READY, fatal faults), the health sweep
    (DEGRADED, OFFLINE), the heartbeat (recovery, BUSY ⇄ READY), the operator (DRAINING, and
    back to READY on undrain) and the drain's progress (DRAINING → DRAINED, once the node's
    deployments have moved or stopped and its last job has finished: node_drain_advance)."""

    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"
    BUSY = "BUSY"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    DEGRADED = "DEGRADED"
    OFFLINE = "OFFLINE"
    ERROR = "ERROR"


S = NodeState

TRANSITIONS: dict[str, frozenset[str]] = {
    S.UNINITIALIZED: frozenset({S.REGISTERING, S.OFFLINE, S.ERROR}),
    S.REGISTERING: frozenset({S.READY, S.DEGRADED, S.OFFLINE, S.ERROR, S.DRAINING}),
    S.READY: frozenset({S.BUSY, S.DRAINING, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.BUSY: frozenset({S.READY, S.DRAINING, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.DRAINING: frozenset({S.DRAINED, S.READY, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    # Drained: holds no work. Undrain → READY; silence → DEGRADED/OFFLINE (a heartbeat afterwards
    # drains it again, at once, since it still holds nothing); a restarted agent → REGISTERING.
    S.DRAINED: frozenset({S.READY, S.DEGRADED, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.DEGRADED: frozenset({S.READY, S.BUSY, S.DRAINING, S.OFFLINE, S.ERROR, S.REGISTERING}),
    S.OFFLINE: frozenset({S.READY, S.BUSY, S.DRAINING, S.DEGRADED, S.ERROR, S.REGISTERING}),
    # ERROR is unrecoverable for the running agent: only a new handshake (restart) leaves it.
    S.ERROR: frozenset({S.REGISTERING, S.OFFLINE}),
}

# Named groups: every caller uses these instead of writing states out by hand.
# Scheduler eligibility for new placements: only READY takes new work, DEGRADED is a fallback when
# nothing else fits, and every other state (DRAINING, OFFLINE, ERROR, BUSY, ...) is never placed on.
SCHEDULABLE = frozenset({S.READY})
FALLBACK = frozenset({S.DEGRADED})
PLACEABLE = SCHEDULABLE | FALLBACK
# States the health sweep watches for late heartbeats (DEGRADED ones may still go OFFLINE).
LIVE = frozenset({S.READY, S.BUSY, S.DRAINING, S.DRAINED, S.REGISTERING})
HEALTH_WATCHED = LIVE | {S.DEGRADED}
# What the health sweep moves a silent node to; its next heartbeat restores it (HEARTBEAT_RESTORED).
HEALTH_VERDICTS = frozenset({S.DEGRADED, S.OFFLINE})
# The pool: nodes that count towards the cluster's capacity (dashboard, metrics, summaries).
POOL = frozenset({S.READY, S.BUSY, S.DEGRADED, S.DRAINING})
# Nodes a deployment's model may be loaded onto now.
LOADABLE = frozenset({S.READY, S.BUSY, S.DEGRADED})
# Members that let a DEGRADED deployment count as healthy again.
HEALTHY = frozenset({S.READY, S.BUSY, S.DRAINING})
# Peers worth a link probe: up and taking work.
ONLINE = frozenset({S.READY, S.BUSY})
# A member in one of these is gone: its deployments fail and its streams end.
LOST = frozenset({S.OFFLINE, S.ERROR})
# Arrivals that deployments react to (degrade, restore, fail): node_state_changed is sent for them.
# (A drain reaches the deployments through its own steps: hooks.drain_step_register.)
DEPLOYMENT_SIGNALS = LOST | {S.DEGRADED, S.READY}
# Diagnostics flag these.
UNHEALTHY = LOST | {S.DEGRADED}
# A drain request moves these to DRAINING at once; an OFFLINE node drains on its next heartbeat.
DRAINABLE = frozenset({S.READY, S.BUSY, S.DEGRADED, S.REGISTERING})
# Draining or drained: no new job is routed to a deployment with a member in one of these.
DRAIN_STATES = frozenset({S.DRAINING, S.DRAINED})


def can_transition(src: str, dst: str) -> bool:
    return dst in TRANSITIONS.get(src, frozenset())


def health_state(
    *, age: float, interval: float, degraded_after: float, offline_after: float
) -> str | None:
    """What a heartbeat this many seconds old means: None (healthy), DEGRADED or OFFLINE."""
    if age >= offline_after * interval:
        return S.OFFLINE
    if age >= degraded_after * interval:
        return S.DEGRADED
    return None


class Engine(models.TextChoices):
    """The inference engines a node can run and a deployment can use (issue 30)."""

    LLAMACPP = "llamacpp", "llama.cpp"
    VLLM = "vllm", "vLLM"
