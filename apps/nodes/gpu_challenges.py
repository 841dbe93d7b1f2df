"""GPU speed claims checked with timed work on the GPU itself (issue 25, compute-plane trust).

A GPU's figure decides how many layers it gets and whether its node may become a primary (which
reads every prompt), and the figure is the agent's own claim. Until a challenge passes, the
scheduler plans the GPU at a floor (apps/jobs/selectors.py, _gpu_speed) and never makes its node
the primary while another node can be.

The challenge: the node multiplies two matrices from a fresh seed on the named device, through its
own llama.cpp build (agent/runtime/ggml_matmul.py, in a child of the agent), and answers the
product mod a small prime; the controller checks it with Freivalds' algorithm
(agent/hardware/gpu_challenge.py) and times the round trip itself. A tiny warm-up challenge just
before measures the fixed costs (the child's start, the backend's initialisation), and at most
that much, never more than GPU_CHALLENGE_OVERHEAD_MAX_SECONDS nor half the timed round trip, is
subtracted. The measured figure is a lower bound on the device's speed: it includes the inputs'
generation and transfer.

- wrong or missing answer, or too late for the claim (claimed > measured × SPEED_CHALLENGE_SLACK):
  failed, with an event naming the claimed and the measured figures; the node's GPUs stay at the
  floor and it is not challenged again until an operator clears the failure;
- otherwise verified: the GPU is planned at min(claim, measured) (its measured figure when it
  claimed none).

At most one challenge per node per GPU_CHALLENGE_INTERVAL_SECONDS. The state lives in the node's
inventory, under keys the agent cannot send (its serializer drops them) and that a re-enrollment
keeps (gpu_challenge_kept): hardware["gpu_challenge"] = {"last_at", "failed"} and each GPU's
"verified_gflops".
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from agent.hardware.gpu_challenge import challenge_flops, freivalds_check
from racon.celery import task_send_on_commit
from racon.redis import get_redis

from .commands import command_send, command_wait
from .events import event_record
from .models import EventCategory, Node

STATE_KEY = "gpu_challenge"
WARMUP_SIDE = 32  # the warm-up product: 32×32×32, nothing but the fixed costs


class ChallengeRefused(Exception):
    """A challenge that may not run now (rate limit, a failure standing, nothing to challenge)."""

    def __init__(self, message: str, *, code: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True)
class GpuVerdict:
    outcome: str  # verified | failed
    device: str
    claimed: float | None
    measured: float
    credited: float
    message: str


def _parse(at: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(at)) if at else None
    except ValueError:
        return None


def gpu_challenge_state(*, node: Node) -> dict[str, Any]:
    """The node's challenge state: {"last_at": iso or absent, "failed": {...} or absent}."""
    state = (node.hardware or {}).get(STATE_KEY)
    return dict(state) if isinstance(state, dict) else {}


def _lock_key(node_id: Any) -> str:
    return f"racon:gpu_challenge:{node_id}"


def gpu_challenge_refusal(*, node: Node, now: datetime) -> ChallengeRefused | None:
    """Why the node may not be challenged now, or None when it may."""
    state = gpu_challenge_state(node=node)
    if state.get("failed"):
        return ChallengeRefused(
            "a failed GPU challenge stands until an operator clears it "
            f"({state['failed'].get('message', '')})",
            code="gpu_challenge_failed",
        )
    last = _parse(state.get("last_at"))
    interval = timedelta(seconds=float(settings.GPU_CHALLENGE_INTERVAL_SECONDS))
    if last is not None and now - last < interval:
        wait = math.ceil((last + interval - now).total_seconds())
        return ChallengeRefused(
            f"at most one GPU challenge per node every {interval.total_seconds():.0f} s: "
            f"the next in {wait} s",
            code="rate_limited",
            retry_after=wait,
        )
    if not _unverified(node):
        return ChallengeRefused("the node has no unverified GPU", code="nothing_to_challenge")
    return None


def _unverified(node: Node) -> list[dict[str, Any]]:
    gpus = (node.hardware or {}).get("gpus") or []
    return [g for g in gpus if not float(g.get("verified_gflops") or 0) and g.get("device")]


def gpu_challenge_due(*, node_id: Any, now: datetime) -> bool:
    """Whether a READY node should be challenged on its own: GPU_CHALLENGE is on, a hardware GPU
    (not a software device: lavapipe is the CPU again) is unverified, and nothing refuses it."""
    node = Node.objects.filter(pk=node_id, revoked_at__isnull=True).first()
    if node is None or not settings.GPU_CHALLENGE:
        return False
    if not any(not g.get("software") for g in _unverified(node)):
        return False
    return gpu_challenge_refusal(node=node, now=now) is None


def gpu_challenge_size(claimed_gflops: float | None) -> tuple[int, int, int]:
    """(m, n, k): GPU_CHALLENGE_SECONDS of work at the claimed speed (at the unverified floor
    when the GPU claims none), within GPU_CHALLENGE_MAX_SIDE and GPU_CHALLENGE_MAX_K."""
    side = int(settings.GPU_CHALLENGE_MAX_SIDE)
    rate = claimed_gflops or float(settings.SPEED_UNVERIFIED_GFLOPS)
    target = rate * 1e9 * float(settings.GPU_CHALLENGE_SECONDS)
    k = math.ceil(target / (2.0 * side * side))
    return side, side, max(16, min(int(settings.GPU_CHALLENGE_MAX_K), k))


def _round_trip(
    *, node_id: Any, device: str, seed: int, m: int, n: int, k: int
) -> tuple[str | None, str, float]:
    """Send one gpu_challenge and wait: (answer or None, error, seconds as the controller saw)."""
    timeout = float(settings.GPU_CHALLENGE_TIMEOUT_SECONDS)
    started = time.monotonic()
    command_id = command_send(
        node_id=node_id,
        kind="gpu_challenge",
        payload={"device": device, "seed": seed, "m": m, "n": n, "k": k},
    )
    result = command_wait(command_id=command_id, timeout=timeout)
    elapsed = time.monotonic() - started
    if not result:
        return None, f"no answer within {timeout:.0f} s", elapsed
    if not result.get("ok"):
        return None, str(result.get("error") or "refused"), elapsed
    return str(result.get("answer") or ""), "", elapsed


def node_gpu_challenge(*, node_id: Any, now: datetime, device: str | None = None) -> GpuVerdict:
    """Challenge one unverified GPU of the node (the first, or ``device``); record the verdict.

    Raises ChallengeRefused when the node may not be challenged now (rate limit, a failure
    standing, no unverified GPU, a challenge of it already running)."""
    node = Node.objects.get(pk=node_id)
    refused = gpu_challenge_refusal(node=node, now=now)
    if refused is not None:
        raise refused
    gpus = _unverified(node)
    gpu = next((g for g in gpus if device is None or g.get("device") == device), None)
    if gpu is None:
        raise ChallengeRefused(f"no unverified GPU named {device}", code="nothing_to_challenge")
    # One at a time per node: the rate limit's record is written at the end.
    lock = get_redis().set(
        _lock_key(node.pk), "1", nx=True, ex=int(settings.GPU_CHALLENGE_TIMEOUT_SECONDS) * 2 + 60
    )
    if not lock:
        raise ChallengeRefused("a GPU challenge of this node is running", code="rate_limited")
    try:
        return _challenge(node=node, gpu=gpu, now=now)
    finally:
        get_redis().delete(_lock_key(node.pk))


def _challenge(*, node: Node, gpu: dict[str, Any], now: datetime) -> GpuVerdict:
    name = str(gpu["device"])
    claimed = float(gpu.get("gflops") or 0) or None
    m, n, k = gpu_challenge_size(claimed)
    warm_seed, seed = secrets.randbits(63), secrets.randbits(63)
    w = WARMUP_SIDE
    warm, error, overhead = _round_trip(node_id=node.pk, device=name, seed=warm_seed, m=w, n=w, k=w)
    warm_ok = warm is not None and freivalds_check(warm, seed=warm_seed, m=w, n=w, k=w)
    answer, elapsed = None, 0.0
    if warm_ok:
        answer, error, elapsed = _round_trip(node_id=node.pk, device=name, seed=seed, m=m, n=n, k=k)
    elif warm is not None:
        error = "the warm-up product was wrong"
    # Checked only after the answer arrived (the check never competes with the timed work).
    correct = answer is not None and freivalds_check(answer, seed=seed, m=m, n=n, k=k)
    if answer is not None and not correct:
        error = "the product was wrong"
    allowance = min(overhead, float(settings.GPU_CHALLENGE_OVERHEAD_MAX_SECONDS), elapsed / 2)
    flops = challenge_flops(m=m, n=n, k=k)
    measured = float(f"{flops / max(elapsed - allowance, 1e-6) / 1e9:.4g}") if correct else 0.0
    slack = float(settings.SPEED_CHALLENGE_SLACK)
    floor = "planned at the floor until an operator clears it"
    if not correct:
        outcome, credited = "failed", 0.0
        message = f"GPU challenge on {name} failed ({error}): {_fmt(claimed)} claimed, {floor}"
    elif claimed is not None and claimed > measured * slack:
        outcome, credited = "failed", 0.0
        message = (
            f"GPU challenge on {name} too late for the claim: {_fmt(claimed)} claimed, "
            f"{measured} GFLOPS measured; {floor}"
        )
    else:
        outcome = "verified"
        credited = measured if claimed is None else min(claimed, measured)
        message = f"GPU {name} verified at {credited} GFLOPS ({_fmt(claimed)} claimed, {measured} measured)"
    data = {
        "device": name,
        "uuid": str(gpu.get("uuid") or ""),
        "claimed_gflops": claimed,
        "measured_gflops": measured,
        "credited_gflops": credited,
        "m": m,
        "n": n,
        "k": k,
        "seconds": round(elapsed, 3),
        "overhead_seconds": round(allowance, 3),
        "correct": correct,
    }
    with transaction.atomic():
        row = Node.objects.select_for_update().get(pk=node.pk)
        hardware = dict(row.hardware or {})
        state = {**gpu_challenge_state(node=row), "last_at": now.isoformat()}
        if outcome == "failed":
            state["failed"] = {"device": name, "at": now.isoformat(), "message": message}
        else:
            gpus = [dict(g) for g in hardware.get("gpus") or []]
            for g in gpus:
                # Only the claim that was challenged: a re-enrollment meanwhile brought a new one.
                if (
                    g.get("device") == name
                    and g.get("uuid") == gpu.get("uuid")
                    and (float(g.get("gflops") or 0) or None) == claimed
                ):
                    g["verified_gflops"] = credited
            hardware["gpus"] = gpus
        hardware[STATE_KEY] = state
        Node.objects.filter(pk=row.pk).update(hardware=hardware)
        event_record(
            kind="GPU_SPEED_VERIFIED" if outcome == "verified" else "GPU_CHALLENGE_FAILED",
            category=EventCategory.SECURITY,
            now=now,
            node_id=node.pk,
            message=message,
            data=data,
        )
    return GpuVerdict(outcome, name, claimed, measured, credited, message)


def _fmt(claimed: float | None) -> str:
    return "no figure" if claimed is None else f"{claimed} GFLOPS"


def node_gpu_challenge_clear(*, node_id: Any, now: datetime, by: str = "operator") -> bool:
    """An operator's clearing of the node's challenge record: a failure standing and the rate
    limit are lifted (its GPUs stay unverified, at the floor, until a challenge passes). Returns
    whether there was anything to clear."""
    with transaction.atomic():
        row = Node.objects.select_for_update().get(pk=node_id)
        hardware = dict(row.hardware or {})
        state = gpu_challenge_state(node=row)
        if not state:
            return False
        hardware.pop(STATE_KEY, None)
        Node.objects.filter(pk=row.pk).update(hardware=hardware)
        event_record(
            kind="GPU_CHALLENGE_CLEARED",
            category=EventCategory.SECURITY,
            now=now,
            node_id=row.pk,
            message=f"GPU challenge record cleared by {by}"
            + (
                f" (it had failed: {state['failed'].get('message', '')})"
                if state.get("failed")
                else ""
            ),
            data={"failed": state.get("failed"), "last_at": state.get("last_at"), "by": by},
        )
    return True


def gpu_challenge_kept(*, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A re-enrollment's inventory with what the controller owns carried over: the challenge
    record (so re-enrolling never lifts a failure or the rate limit), and each GPU's verified
    figure where the same GPU (device, uuid) makes the same claim."""
    if not old:
        return new
    out = dict(new)
    if isinstance(old.get(STATE_KEY), dict):
        out[STATE_KEY] = old[STATE_KEY]
    verified = {
        (g.get("device"), g.get("uuid"), float(g.get("gflops") or 0)): g["verified_gflops"]
        for g in old.get("gpus") or []
        if isinstance(g, dict) and g.get("verified_gflops")
    }
    if verified and isinstance(new.get("gpus"), list):
        gpus = []
        for g in new["gpus"]:
            g = dict(g)
            got = verified.get((g.get("device"), g.get("uuid"), float(g.get("gflops") or 0)))
            if got:
                g["verified_gflops"] = got
            gpus.append(g)
        out["gpus"] = gpus
    return out


def node_gpu_challenge_request(*, node_id: Any, now: datetime, device: str | None = None) -> str:
    """An operator's request to challenge the node's GPU now: refused (ChallengeRefused) as a
    challenge itself would be, else queued (task racon.jobs.gpu_challenge). Returns the device."""
    node = Node.objects.get(pk=node_id)
    refused = gpu_challenge_refusal(node=node, now=now)
    if refused is not None:
        raise refused
    gpu = next((g for g in _unverified(node) if device is None or g.get("device") == device), None)
    if gpu is None:
        raise ChallengeRefused(f"no unverified GPU named {device}", code="nothing_to_challenge")
    task_send_on_commit("racon.jobs.gpu_challenge", node_id=str(node.pk), device=gpu["device"])
    return str(gpu["device"])


def gpu_unverified_vram(*, hardware: dict[str, Any]) -> int:
    """Free VRAM of the node's GPUs that no challenge verified: what crediting leaves out until
    one passes (the floor: a GPU's claim alone earns nothing beyond the node's own RAM)."""
    return sum(
        max(int(g.get("vram_free") or 0), 0)
        for g in (hardware or {}).get("gpus") or []
        if isinstance(g, dict) and not float(g.get("verified_gflops") or 0)
    )
