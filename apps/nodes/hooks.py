"""What the node registry tells, and asks, the apps above it (models_repo, jobs).

nodes sits below them, so it never imports them: it sends signals they receive, and asks
questions through functions they register at start-up (their ``AppConfig.ready``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

from racon.ids import NodeId

# Sent with node_id, files (the agent's [{"sha256", "path"}, ...]) and now when an agent's
# handshake lists the model files it holds (models_repo records them as replicas).
node_models_reported = Signal()
# Sent with node_id, old and new (states) after a node's transition commits, in the process that
# made it (jobs drops its route cache when a node starts or stops draining). Must not raise.
node_state_moved = Signal()

RunningWorkCheck = Callable[..., bool]  # (*, node_id) -> bool
_running_work_checks: dict[str, RunningWorkCheck] = {}


def running_work_check_register(*, name: str, check: RunningWorkCheck) -> None:
    """Register a "does this node still run work of yours?" check (jobs: dispatched or running)."""
    _running_work_checks[name] = check


def node_has_running_work(*, node_id: NodeId) -> bool:
    """Whether any registered app says the node still runs its work (a drain waits for it)."""
    return any(check(node_id=node_id) for check in _running_work_checks.values())


DrainStep = Callable[..., bool]  # (*, node_id, now) -> whether the app still has work on the node
_drain_steps: dict[str, DrainStep] = {}


def drain_step_register(*, name: str, step: DrainStep) -> None:
    """Register an app's drain step: move its work off a draining node, stop what has finished,
    and say whether anything of its own is still on the node (jobs: deployments and jobs)."""
    _drain_steps[name] = step


def node_drain_step(*, node_id: NodeId, now: Any) -> bool:
    """Run every registered drain step; whether any app still has work on the node."""
    remaining = [step(node_id=node_id, now=now) for step in _drain_steps.values()]
    return any(remaining) or node_has_running_work(node_id=node_id)
