"""The bounds of the timing-dependent tests, from settings scaled for tests.

The live controllers of the suite run with a one-second heartbeat; a node turns DEGRADED after
HEARTBEAT_DEGRADED_AFTER missed intervals and OFFLINE after HEARTBEAT_OFFLINE_AFTER. On a busy
machine (another build, ``make test-load``'s CPU burner) a heartbeat can come seconds late, so the
windows are wide enough for that as they are (``make test-load`` runs with them), and every bound
a test derives from them scales with RACON_TEST_SLOWDOWN (1 by default) on a slower machine still.
A test asserts order or one of these bounds, never the speed of an idle machine.
"""

from __future__ import annotations

import os

SLOWDOWN = max(1.0, float(os.environ.get("RACON_TEST_SLOWDOWN") or 1))

HEARTBEAT_INTERVAL = 1.0  # seconds, the live controllers' setting
HEARTBEAT_DEGRADED_AFTER = 4 * SLOWDOWN  # intervals
HEARTBEAT_OFFLINE_AFTER = 10 * SLOWDOWN  # intervals


def scaled(seconds: float) -> float:
    """A wait's bound on this machine: ``seconds`` as measured on an idle one, times SLOWDOWN."""
    return seconds * SLOWDOWN


def heartbeat_env() -> dict[str, str]:
    """The heartbeat settings of a live controller started by a test."""
    return {
        "HEARTBEAT_INTERVAL": f"{HEARTBEAT_INTERVAL:g}",
        "HEALTH_SWEEP_SECONDS": "1",
        "HEARTBEAT_DEGRADED_AFTER": f"{HEARTBEAT_DEGRADED_AFTER:g}",
        "HEARTBEAT_OFFLINE_AFTER": f"{HEARTBEAT_OFFLINE_AFTER:g}",
    }


def live_heartbeat_age() -> float:
    """The oldest a READY node's last heartbeat can be (seconds): past it the node is DEGRADED."""
    return HEARTBEAT_INTERVAL * HEARTBEAT_DEGRADED_AFTER + 1
