"""GPU speed claims checked with timed work on the GPU itself (issue 25, compute-plane trust).

A GPU's figure decides how many layers it gets and whether its node may become a primary (which
reads every prompt), and the figure is the agent's own claim. Until a challenge passes, the
scheduler plans the GPU at a floor (apps/jobs/selectors.py, _gpu_speed) and never makes its node
the primary while another node can be.

The challenge has two phases, so that only the work is timed, never the inputs' making or
transfer (agent/hardware/gpu_challenge.py has the arithmetic, agent/runtime/ggml_matmul.py the
node's side), each a gpu_challenge command of one step:

1. ``prepare`` (untimed): a fresh challenge id and seed; the node builds A and B from the seed on
   the named device, through its own llama.cpp build in a child of the agent, runs the graph once
   with a zero scale (the fixed costs) and answers that it is ready, naming the challenge, the
   device and the shape: anything else fails;
2. ``ping`` (untimed): a token through the same path (Redis, the agent, the child, the report):
   the channel's own round trip, of which at most GPU_CHALLENGE_OVERHEAD_MAX_SECONDS and never
   more than a quarter of the timed step is subtracted;
3. ``run`` (timed): only now a fresh nonce, which gives the diagonal D of ``C = B·D·Aᵀ``: nothing
   computed during prepare saves the product (a guess of D saves the terms it guessed right,
   1/64 of them on average). The controller times from sending the nonce to receiving the
   answer, which must name the challenge and echo this nonce (an answer for another nonce is
   stale) with a sha256 of C mod 251: the node commits to its product before the clock stops;
4. ``reveal`` (untimed): the residues, m·n bytes; they must have that shape, hash to the
   committed digest, and pass Freivalds' check against this seed and nonce.

A step's answer comes only as the result of that step's command, whose id exists only once the
controller sent it (apps/nodes/commands.py refuses a result for any other): a node cannot answer
a step before it is asked. The measured figure is the product's FLOPs over the timed step, less
that allowance.

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
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from agent.hardware.gpu_challenge import (
    answer_decode,
    challenge_flops,
    freivalds_check,
    residue_digest,
)
from racon import ids
from racon.celery import task_send_on_commit
from racon.ids import NodeId
from racon.redis import get_redis

from .commands import command_send, command_wait
from .events import event_record
from .models import EventCategory, Node

STATE_KEY = "gpu_challenge"
DIGEST = re.compile(r"[0-9a-f]{64}")


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


def _lock_key(node_id: NodeId) -> str:
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


def gpu_challenge_due(*, node_id: NodeId, now: datetime) -> bool:
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


def node_gpu_challenge(*, node_id: NodeId, now: datetime, device: str | None = None) -> GpuVerdict:
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
        _lock_key(ids.node_id(node.pk)),
        "1",
        nx=True,
        ex=int(settings.GPU_CHALLENGE_TIMEOUT_SECONDS) * 4 + 60,
    )
    if not lock:
        raise ChallengeRefused("a GPU challenge of this node is running", code="rate_limited")
    try:
        return _challenge(node=node, gpu=gpu, now=now)
    finally:
        get_redis().delete(_lock_key(ids.node_id(node.pk)))


class StepFailed(Exception):
    """A step of the challenge that the node did not answer as the protocol says."""


def _step(*, node_id: NodeId, payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Send one gpu_challenge step and wait: (the node's result, seconds as the controller saw
    them, from the send to the result). A refusal or no answer is a StepFailed."""
    timeout = float(settings.GPU_CHALLENGE_TIMEOUT_SECONDS)
    started = time.monotonic()
    command_id = command_send(node_id=node_id, kind="gpu_challenge", payload=payload)
    result = command_wait(command_id=command_id, timeout=timeout)
    elapsed = time.monotonic() - started
    step = payload["step"]
    if not result:
        raise StepFailed(f"no answer to {step} within {timeout:.0f} s")
    if not result.get("ok"):
        raise StepFailed(f"{step} refused: {str(result.get('error') or 'no reason given')[:300]}")
    if result.get("challenge_id") != payload["challenge_id"]:
        raise StepFailed(
            f"the answer to {step} names challenge {str(result.get('challenge_id'))[:80]!r}, "
            f"not {payload['challenge_id']}"
        )
    return result, elapsed


def _prepare(
    *, node_id: NodeId, challenge_id: str, device: str, seed: int, shape: tuple[int, ...]
) -> float:
    m, n, k = shape
    payload = {"step": "prepare", "challenge_id": challenge_id, "device": device,
               "seed": seed, "m": m, "n": n, "k": k}  # fmt: skip
    got, elapsed = _step(node_id=node_id, payload=payload)
    said = (got.get("device"), got.get("m"), got.get("n"), got.get("k"))
    if got.get("ready") is not True or said != (device, m, n, k):
        raise StepFailed(
            f"the answer to prepare is not a ready for {device} at {m}x{n}x{k}: "
            f"ready {got.get('ready')!r}, {said[0]!r} at {said[1]!r}x{said[2]!r}x{said[3]!r}"
        )
    return elapsed


def _ping(*, node_id: NodeId, challenge_id: str) -> float:
    token = secrets.token_hex(8)
    got, elapsed = _step(
        node_id=node_id, payload={"step": "ping", "challenge_id": challenge_id, "token": token}
    )
    if got.get("pong") != token:
        raise StepFailed(f"the answer to ping is not its token: {str(got.get('pong'))[:80]!r}")
    return elapsed


def _run(*, node_id: NodeId, challenge_id: str, nonce: int) -> tuple[str, float]:
    """The timed step: (the committed digest, seconds from the nonce's send to the answer)."""
    got, elapsed = _step(
        node_id=node_id, payload={"step": "run", "challenge_id": challenge_id, "nonce": nonce}
    )
    if got.get("nonce") != nonce:
        raise StepFailed(
            f"the answer to run is for nonce {str(got.get('nonce'))[:40]}, not this one "
            "(a stale or precomputed answer)"
        )
    digest = got.get("digest")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise StepFailed("the answer to run has no digest (64 hex digits) of the product")
    return digest, elapsed


def _reveal(
    *,
    node_id: NodeId,
    challenge_id: str,
    seed: int,
    nonce: int,
    digest: str,
    shape: tuple[int, ...],
) -> None:
    m, n, k = shape
    got, _ = _step(node_id=node_id, payload={"step": "reveal", "challenge_id": challenge_id})
    answer = got.get("answer")
    if not isinstance(answer, str):
        raise StepFailed("the answer to reveal has no product")
    residues = answer_decode(answer, m=m, n=n)
    if residues is None:
        raise StepFailed(
            f"the revealed product is not {m}x{n} residues ({len(answer)} base64 characters, "
            f"{m * n} bytes expected)"
        )
    if residue_digest(residues.tobytes(), nonce=nonce) != digest:
        raise StepFailed("the revealed product is not the one the timed answer committed to")
    # Checked only after the timed step (the check never competes with the timed work).
    if not freivalds_check(answer, seed=seed, nonce=nonce, m=m, n=n, k=k):
        raise StepFailed("the product was wrong")


def _challenge(*, node: Node, gpu: dict[str, Any], now: datetime) -> GpuVerdict:
    name = str(gpu["device"])
    claimed = float(gpu.get("gflops") or 0) or None
    m, n, k = gpu_challenge_size(claimed)
    shape = (m, n, k)
    challenge_id, seed = secrets.token_hex(16), secrets.randbits(63)
    prepare_s = overhead = elapsed = 0.0
    correct, error = False, ""
    try:
        prepare_s = _prepare(
            node_id=ids.node_id(node.pk),
            challenge_id=challenge_id,
            device=name,
            seed=seed,
            shape=shape,
        )
        overhead = _ping(node_id=ids.node_id(node.pk), challenge_id=challenge_id)
        # Drawn only now: nothing before this send can depend on it.
        nonce = secrets.randbits(63)
        digest, elapsed = _run(node_id=ids.node_id(node.pk), challenge_id=challenge_id, nonce=nonce)
        _reveal(
            node_id=ids.node_id(node.pk),
            challenge_id=challenge_id,
            seed=seed,
            nonce=nonce,
            digest=digest,
            shape=shape,
        )
        correct = True
    except StepFailed as exc:
        error = str(exc)
    allowance = min(overhead, float(settings.GPU_CHALLENGE_OVERHEAD_MAX_SECONDS), elapsed / 4)
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
        "prepare_seconds": round(prepare_s, 3),
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
            node_id=ids.node_id(node.pk),
            message=message,
            data=data,
        )
    return GpuVerdict(outcome, name, claimed, measured, credited, message)


def _fmt(claimed: float | None) -> str:
    return "no figure" if claimed is None else f"{claimed} GFLOPS"


def node_gpu_challenge_clear(*, node_id: NodeId, now: datetime, by: str = "operator") -> bool:
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
            node_id=ids.node_id(row.pk),
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


def node_gpu_challenge_request(*, node_id: NodeId, now: datetime, device: str | None = None) -> str:
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
