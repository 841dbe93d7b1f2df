"""GPU speed claims timed on the GPU (issue 25 item 4): the controller's side against an agent
stand-in that answers gpu_challenge commands from the node's real Redis queue, as the agent's
handler does (the real GPU path runs in tests/e2e/test_gpu_challenge_lavapipe.py)."""

from __future__ import annotations

import base64
import json
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from django.test import Client
from django.utils import timezone

from agent.hardware.gpu_challenge import (
    SCALE_MAX,
    answer_encode,
    challenge_inputs,
    freivalds_check,
    nonce_scale,
    reference_answer,
    reference_product,
    residue_digest,
    residues,
)
from agent.protocol import new_id, node_queue_key
from apps.jobs.selectors import gpu_verified
from apps.nodes.commands import command_result_accept
from apps.nodes.errors import ReportRefused
from apps.nodes.gpu_challenges import (
    ChallengeRefused,
    gpu_challenge_due,
    gpu_challenge_kept,
    node_gpu_challenge,
    node_gpu_challenge_clear,
)
from apps.nodes.models import Event, Node
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis
from tests.factories import NodeFactory, hardware_profile

pytestmark = pytest.mark.django_db(transaction=True)

GIB = 1 << 30
OPERATOR = {"Authorization": "Bearer test-operator-key"}


@pytest.fixture(autouse=True)
def small_challenges(settings: Any) -> None:
    settings.GPU_CHALLENGE_MAX_SIDE = 64
    settings.GPU_CHALLENGE_MAX_K = 256
    settings.GPU_CHALLENGE_TIMEOUT_SECONDS = 30.0


def gpu_node(*, claimed: float | None = None, software: bool = False) -> Node:
    gpu: dict[str, Any] = {
        "index": 0, "vendor": "nvidia", "name": "GPU", "uuid": "GPU-1", "vram_total": 8 * GIB,
        "vram_free": 8 * GIB, "driver": "x", "device": "CUDA0", "backend": "CUDA",
    }  # fmt: skip
    if claimed is not None:
        gpu["gflops"] = claimed
    if software:
        gpu["software"] = True
    return NodeFactory(hardware=hardware_profile(gpus=[gpu]))


class GpuAgent(threading.Thread):
    """Answers the node's gpu_challenge steps from its real Redis queue as the agent's
    GpuChallengeSteps does (the product by numpy here, on the GPU in the agent), or breaks the
    protocol one way (``mode``): a late run (``delay``), a wrong product committed to, a product
    that ignores the nonce (precomputed during prepare), a stale nonce, a reveal that is not the
    committed product, a ready for another shape, a reveal of the wrong size."""

    def __init__(self, node_id: str, *, mode: str = "honest", delay: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.node_id, self.mode, self.delay = node_id, mode, delay
        self.seen: list[dict[str, Any]] = []
        self.prepared: dict[str, Any] = {}
        self.raw = b""
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            got = get_redis().blpop([node_queue_key(self.node_id)], timeout=1)
            if got is None:
                continue
            cmd = json.loads(got[1])
            self.seen.append(cmd)
            result = self.answer(cmd["payload"])
            command_result_accept(
                node_id=NodeId(self.node_id),
                command_id=cmd["id"],
                payload={"ok": True, "challenge_id": cmd["payload"]["challenge_id"], **result},
                now=timezone.now(),
            )

    def answer(self, p: dict[str, Any]) -> dict[str, Any]:
        step = p["step"]
        if step == "prepare":
            self.prepared = p
            k = p["k"] + 1 if self.mode == "other_shape" else p["k"]
            return {"ready": True, "device": p["device"], "m": p["m"], "n": p["n"], "k": k}
        if step == "ping":
            return {"pong": p["token"]}
        q = self.prepared
        if step == "run":
            nonce = p["nonce"]
            time.sleep(self.delay)
            if self.mode == "precomputed":  # B·Aᵀ from the prepare, the nonce ignored
                a, b = challenge_inputs(seed=q["seed"], m=q["m"], n=q["n"], k=q["k"])
                product = b.astype(np.float32) @ a.astype(np.float32).T
            else:
                product = reference_product(
                    seed=q["seed"], nonce=nonce, m=q["m"], n=q["n"], k=q["k"]
                )
            flipped = bytearray(residues(product))
            if self.mode == "wrong":
                flipped[7] = (flipped[7] + 1) % 251
            self.raw = bytes(flipped)
            digest = residue_digest(self.raw, nonce=nonce)
            if self.mode == "uncommitted":  # answers at once, computes later
                digest = "0" * 64
            return {"nonce": nonce + 1 if self.mode == "stale" else nonce, "digest": digest}
        raw = self.raw[:-1] if self.mode == "short" else self.raw
        return {"answer": base64.b64encode(raw).decode()}


def challenged(node: Node, **agent: Any) -> Any:
    stand_in = GpuAgent(str(node.id), **agent)
    stand_in.start()
    try:
        return node_gpu_challenge(node_id=ids.node_id(node.id), now=timezone.now())
    finally:
        stand_in.stop.set()
        stand_in.join(30)


def test_freivalds_accepts_the_product_and_refuses_one_wrong_entry() -> None:
    answer = reference_answer(seed=7, nonce=11, m=40, n=24, k=300)
    assert freivalds_check(answer, seed=7, nonce=11, m=40, n=24, k=300)
    raw = bytearray(base64.b64decode(answer))
    raw[123] = (raw[123] + 1) % 251
    wrong = base64.b64encode(bytes(raw)).decode()
    assert not freivalds_check(wrong, seed=7, nonce=11, m=40, n=24, k=300)
    assert not freivalds_check(answer, seed=8, nonce=11, m=40, n=24, k=300)  # another seed
    assert not freivalds_check(answer[:-8], seed=7, nonce=11, m=40, n=24, k=300)  # short
    assert not freivalds_check("not base64!", seed=7, nonce=11, m=40, n=24, k=300)


def test_the_nonce_changes_the_product_so_nothing_before_it_answers() -> None:
    seed, m, n, k = 7, 40, 24, 300
    one, other = (reference_answer(seed=seed, nonce=x, m=m, n=n, k=k) for x in (11, 12))
    assert one != other
    assert not freivalds_check(one, seed=seed, nonce=12, m=m, n=n, k=k)  # another nonce's
    # What a node could compute during prepare: B·Aᵀ, or the product for a guessed D.
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    plain = answer_encode(b.astype(np.float32) @ a.astype(np.float32).T)
    assert not freivalds_check(plain, seed=seed, nonce=11, m=m, n=n, k=k)
    d = nonce_scale(nonce=11, k=k)
    assert d.min() >= -SCALE_MAX and d.max() <= SCALE_MAX and (d != 0).all()
    assert len(set(d.tolist())) > SCALE_MAX  # both signs, most magnitudes
    # Exact in float32: the largest sum the agent's bounds allow stays below 2**24.
    assert SCALE_MAX * 65536 < 2**24


def test_an_honest_gpu_without_a_claim_is_verified_at_its_measured_figure() -> None:
    node = gpu_node()
    assert not gpu_verified(node.hardware["gpus"][0])
    verdict = challenged(node)
    assert verdict.outcome == "verified" and verdict.measured > 0
    assert verdict.credited == verdict.measured and verdict.claimed is None
    node.refresh_from_db()
    assert node.hardware["gpus"][0]["verified_gflops"] == verdict.measured
    assert gpu_verified(node.hardware["gpus"][0])
    event = Event.objects.get(node=node, kind="GPU_SPEED_VERIFIED")
    assert event.data["device"] == "CUDA0" and event.data["measured_gflops"] == verdict.measured


def test_a_900_tflops_claim_answered_right_but_slowly_fails_naming_both_figures() -> None:
    node = gpu_node(claimed=900_000.0)
    verdict = challenged(node, delay=0.5)
    assert verdict.outcome == "failed" and 0 < verdict.measured < 900_000.0 / 1.5
    node.refresh_from_db()
    assert not gpu_verified(node.hardware["gpus"][0])  # still at the floor
    event = Event.objects.get(node=node, kind="GPU_CHALLENGE_FAILED")
    assert "900000.0 GFLOPS claimed" in event.message and str(verdict.measured) in event.message
    assert event.data["claimed_gflops"] == 900_000.0
    assert event.data["measured_gflops"] == verdict.measured


def test_a_wrong_product_fails_the_challenge() -> None:
    node = gpu_node(claimed=1.0)
    verdict = challenged(node, mode="wrong")
    assert verdict.outcome == "failed" and verdict.measured == 0.0
    event = Event.objects.get(node=node, kind="GPU_CHALLENGE_FAILED")
    assert "wrong" in event.message and event.data["correct"] is False


@pytest.mark.parametrize(
    ("mode", "why", "last"),
    [
        ("precomputed", "the product was wrong", "reveal"),
        ("stale", "not this one (a stale or precomputed answer)", "run"),
        ("uncommitted", "not the one the timed answer committed to", "reveal"),
        ("other_shape", "not a ready for CUDA0 at 64x64x", "prepare"),
        ("short", "not 64x64 residues", "reveal"),
    ],
)
def test_an_answer_out_of_protocol_fails_naming_why(mode: str, why: str, last: str) -> None:
    node = gpu_node(claimed=1.0)
    stand_in = GpuAgent(str(node.id), mode=mode)
    stand_in.start()
    try:
        verdict = node_gpu_challenge(node_id=ids.node_id(node.id), now=timezone.now())
    finally:
        stand_in.stop.set()
        stand_in.join(30)
    assert verdict.outcome == "failed" and verdict.measured == 0.0, verdict
    assert why in verdict.message, verdict.message
    # Each step only after the one before was answered as the protocol says, none after a fault.
    steps = [c["payload"]["step"] for c in stand_in.seen]
    order = ["prepare", "ping", "run", "reveal"]
    assert steps == order[: order.index(last) + 1]
    # The nonce went out only in the run, after the node said it was ready.
    assert [c["payload"]["step"] for c in stand_in.seen if "nonce" in c["payload"]] == (
        ["run"] if "run" in steps else []
    )
    event = Event.objects.get(node=node, kind="GPU_CHALLENGE_FAILED")
    assert why in event.message and event.data["correct"] is False


def test_a_run_answered_after_the_step_timeout_fails(settings: Any) -> None:
    settings.GPU_CHALLENGE_TIMEOUT_SECONDS = 1.0
    node = gpu_node()  # no claim: only the timeout can fail it
    verdict = challenged(node, delay=2.5)
    assert verdict.outcome == "failed" and verdict.measured == 0.0, verdict
    assert "no answer to run within 1 s" in verdict.message, verdict.message


def test_a_step_answered_before_it_is_asked_is_refused() -> None:
    """A result can only answer a command the controller sent: a run's answer sent ahead (the
    node guessing the command) has no command to answer."""
    node = gpu_node()
    with pytest.raises(ReportRefused) as refused:
        command_result_accept(
            node_id=ids.node_id(node.id),
            command_id=new_id(),
            payload={"ok": True, "challenge_id": "ab" * 16, "nonce": 1, "digest": "0" * 64},
            now=timezone.now(),
        )
    assert refused.value.code == "unknown_command"


def test_at_most_one_challenge_per_node_per_hour(settings: Any) -> None:
    node = gpu_node()
    node.hardware["gpus"].append({**node.hardware["gpus"][0], "device": "CUDA1", "uuid": "GPU-2"})
    Node.objects.filter(pk=node.pk).update(hardware=node.hardware)
    assert challenged(node).outcome == "verified"  # CUDA0; CUDA1 is still unverified
    with pytest.raises(ChallengeRefused) as refused:
        node_gpu_challenge(node_id=ids.node_id(node.id), now=timezone.now())
    assert refused.value.code == "rate_limited" and 3500 < (refused.value.retry_after or 0) <= 3600
    assert not gpu_challenge_due(node_id=ids.node_id(node.id), now=timezone.now())
    later = timezone.now() + timedelta(seconds=settings.GPU_CHALLENGE_INTERVAL_SECONDS + 1)
    assert gpu_challenge_due(node_id=ids.node_id(node.id), now=later)


def test_a_failed_challenge_stands_until_an_operator_clears_it() -> None:
    node = gpu_node(claimed=900_000.0)
    assert challenged(node, delay=0.3).outcome == "failed"
    next_week = timezone.now() + timedelta(days=7)
    with pytest.raises(ChallengeRefused) as refused:
        node_gpu_challenge(node_id=ids.node_id(node.id), now=next_week)
    assert refused.value.code == "gpu_challenge_failed"
    assert not gpu_challenge_due(node_id=ids.node_id(node.id), now=next_week)
    assert node_gpu_challenge_clear(node_id=ids.node_id(node.id), now=timezone.now())
    assert Event.objects.filter(node=node, kind="GPU_CHALLENGE_CLEARED").exists()
    node.refresh_from_db()
    assert not gpu_verified(node.hardware["gpus"][0])  # cleared is not verified
    assert gpu_challenge_due(node_id=ids.node_id(node.id), now=timezone.now())


def test_a_software_gpu_is_not_challenged_on_its_own() -> None:
    assert not gpu_challenge_due(
        node_id=ids.node_id(gpu_node(software=True).id), now=timezone.now()
    )


def test_re_enrollment_keeps_the_record_and_the_verified_figure_of_the_same_claim() -> None:
    gpu = {"device": "CUDA0", "uuid": "GPU-1", "gflops": 100.0}
    old = {
        "gpus": [{**gpu, "verified_gflops": 90.0}],
        "gpu_challenge": {"failed": {"message": "x"}, "last_at": "2026-01-01T00:00:00+00:00"},
    }
    same = gpu_challenge_kept(old=old, new={"gpus": [dict(gpu)]})
    assert same["gpus"][0]["verified_gflops"] == 90.0
    assert same["gpu_challenge"] == old["gpu_challenge"]  # re-enrolling lifts no failure
    bigger = gpu_challenge_kept(old=old, new={"gpus": [{**gpu, "gflops": 900_000.0}]})
    assert "verified_gflops" not in bigger["gpus"][0]  # a new claim is a new, unverified one


def test_operator_api_queues_refuses_and_clears(client: Client) -> None:
    node = gpu_node(claimed=900_000.0)
    url = f"/api/admin/nodes/{node.id}/gpu-challenge"

    def ask() -> Any:
        # Tests run Celery eagerly: the queued challenge runs inside the request.
        stand_in = GpuAgent(str(node.id), delay=0.3)
        stand_in.start()
        try:
            return client.post(
                url, {"device": "CUDA0"}, content_type="application/json", headers=OPERATOR
            )
        finally:
            stand_in.stop.set()
            stand_in.join(30)

    resp = ask()
    assert resp.status_code == 202 and resp.json()["device"] == "CUDA0", resp.content
    assert Event.objects.filter(node=node, kind="GPU_CHALLENGE_FAILED").count() == 1
    resp = client.post(url, {}, content_type="application/json", headers=OPERATOR)
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "gpu_challenge_failed"
    resp = client.post(url + "/clear", headers=OPERATOR)
    assert resp.status_code == 200 and resp.json()["cleared"] is True
    assert ask().status_code == 202
    assert Event.objects.filter(node=node, kind="GPU_CHALLENGE_FAILED").count() == 2
    resp = client.post(url, {}, content_type="application/json", headers=OPERATOR)
    assert resp.status_code == 409  # failed again: stands again
