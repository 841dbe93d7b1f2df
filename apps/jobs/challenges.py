"""Speed claims checked upward with timed work (compute-plane trust).

A node's benchmark figure decides how much work the scheduler gives it, and which node becomes a
primary (and so sees the prompts). The figure is the agent's own claim, so a claim above
SPEED_UNVERIFIED_GFLOPS is credited only that much until the node has done timed work the
controller can check: a chain of 512×512 float32 matmuls from a fresh seed
(agent.hardware.benchmark.speed_challenge_digest), sized to last SPEED_CHALLENGE_SECONDS at the
claimed speed. The controller times the round trip itself (so the figure it measures can only be
lower than the node's true speed) and recomputes the chain to check the answer afterwards.
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from agent.hardware.benchmark import CHALLENGE_N, speed_challenge_digest, speed_challenge_flops
from apps.nodes.commands import command_send, command_wait
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory, Node
from racon import ids
from racon.ids import NodeId


@dataclass(frozen=True)
class SpeedVerdict:
    outcome: str  # verified | reduced | failed | skipped
    claimed: float
    measured: float
    credited: float


def speed_challenge_size(claimed_gflops: float) -> int:
    """Chain length: SPEED_CHALLENGE_SECONDS of work at the claimed speed, at most SPEED_CHALLENGE_MAX_REPS."""
    per_rep = speed_challenge_flops(n=CHALLENGE_N, reps=1)
    reps = math.ceil(claimed_gflops * 1e9 * float(settings.SPEED_CHALLENGE_SECONDS) / per_rep)
    return max(1, min(int(settings.SPEED_CHALLENGE_MAX_REPS), reps))


def _due(node: Node) -> bool:
    return bool(
        settings.SPEED_CHALLENGE
        and node.revoked_at is None
        and node.speed_verified_at is None
        and node.gflops < node.gflops_claimed
    )


def speed_challenge_due(*, node_id: NodeId) -> bool:
    """Whether the node holds a speed claim above what it is credited with and not yet checked.

    Asked when the node turns READY: only then does its agent read its command queue, so the
    controller's stopwatch times the work and not the agent's start-up."""
    node = Node.objects.filter(pk=node_id).first()
    return node is not None and _due(node)


def node_speed_challenge(*, node_id: NodeId, now: datetime) -> SpeedVerdict:
    """Challenge the node's current gflops claim; set what the scheduler credits it with."""
    node = Node.objects.get(pk=node_id)
    claimed = float(node.gflops_claimed)
    if not _due(node):
        return SpeedVerdict(outcome="skipped", claimed=claimed, measured=0.0, credited=node.gflops)
    reps = speed_challenge_size(claimed)
    seed = secrets.randbits(63)
    flops = speed_challenge_flops(n=CHALLENGE_N, reps=reps)
    # Generous: ten times the claimed duration, plus the command queue's own latency.
    timeout = 10.0 + 10.0 * flops / (claimed * 1e9)
    started = time.monotonic()
    command_id = command_send(
        node_id=ids.node_id(node.id),
        kind="speed_challenge",
        payload={"seed": seed, "n": CHALLENGE_N, "reps": reps},
    )
    result = command_wait(command_id=command_id, timeout=timeout)
    elapsed = time.monotonic() - started
    # Recomputed only after the node answered, so the check never competes with the work it times.
    expected = speed_challenge_digest(seed=seed, n=CHALLENGE_N, reps=reps)
    answered = bool(result and result.get("ok"))
    correct = answered and hmac.compare_digest(str((result or {}).get("digest", "")), expected)
    measured = round(flops / elapsed / 1e9, 2) if correct else 0.0
    floor = float(settings.SPEED_UNVERIFIED_GFLOPS)
    if not correct:
        outcome, credited = "failed", floor
        message = (
            f"speed challenge {'answered wrongly' if answered else 'not answered'}: "
            f"{claimed} GFLOPS claimed, {floor} credited"
        )
    elif claimed <= measured * float(settings.SPEED_CHALLENGE_SLACK):
        outcome, credited = "verified", claimed
        message = f"speed claim {claimed} GFLOPS confirmed: {measured} GFLOPS measured end to end"
    else:
        outcome, credited = "reduced", max(floor, measured)
        message = f"speed claim {claimed} GFLOPS is above the {measured} GFLOPS measured: {credited} credited"
    # Only the claim that was challenged is settled: a re-enrollment meanwhile brought a new one.
    updated = Node.objects.filter(pk=node.id, gflops_claimed=claimed).update(
        gflops=credited, speed_verified_at=now if outcome != "failed" else None
    )
    if updated:
        event_record(
            kind={
                "verified": "SPEED_VERIFIED",
                "reduced": "SPEED_CLAIM_REDUCED",
                "failed": "SPEED_CHALLENGE_FAILED",
            }[outcome],
            category=EventCategory.SECURITY,
            now=now,
            node_id=ids.node_id(node.id),
            message=message,
            data={
                "claimed_gflops": claimed,
                "measured_gflops": measured,
                "credited_gflops": credited,
                "reps": reps,
                "n": CHALLENGE_N,
                "seconds": round(elapsed, 3),
                "answered": answered,
            },
        )
    return SpeedVerdict(outcome=outcome, claimed=claimed, measured=measured, credited=credited)
