"""The node's side of the two-phase GPU challenge (agent/runtime/ggml_matmul.py,
GpuChallengeSteps): each controller step is checked against the challenge the node holds, and the
work is real, through ggml's own CPU device in the challenge's child (the Vulkan and CUDA devices
run the same child: tests/agent/test_gpu_challenge_child.py, scripts/device-check.sh)."""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import Iterator

import pytest

from agent.commands import GPU_DEVICE_NAME
from agent.hardware.gpu_challenge import freivalds_check, reference_answer, residue_digest
from agent.runtime.ggml_matmul import ChallengeChild, GpuChallengeSteps, StepRefused

M, N, K = 24, 16, 96


@pytest.fixture
def steps() -> Iterator[GpuChallengeSteps]:
    # device_name None: the CPU device is not a GPU name, but runs the very same child.
    got = GpuChallengeSteps(max_side=64, max_k=512, device_name=None, timeout=120)
    yield got
    got.close()


def prepare(steps: GpuChallengeSteps, cid: str, seed: int = 5) -> dict[str, object]:
    return steps.step({"step": "prepare", "challenge_id": cid, "device": "CPU", "seed": seed,
                       "m": M, "n": N, "k": K})  # fmt: skip


def test_prepare_then_the_nonce_gives_the_committed_product(steps: GpuChallengeSteps) -> None:
    cid = secrets.token_hex(16)
    ready = prepare(steps, cid)
    assert ready == {"step": "prepare", "challenge_id": cid, "ready": True, "device": "CPU",
                     "m": M, "n": N, "k": K}  # fmt: skip
    assert steps.step({"step": "ping", "challenge_id": cid, "token": "t1"})["pong"] == "t1"
    nonce = secrets.randbits(63)
    ran = steps.step({"step": "run", "challenge_id": cid, "nonce": nonce})
    assert ran["nonce"] == nonce and len(str(ran["digest"])) == 64
    answer = str(steps.step({"step": "reveal", "challenge_id": cid})["answer"])
    assert residue_digest(base64.b64decode(answer), nonce=nonce) == ran["digest"]
    assert answer == reference_answer(seed=5, nonce=nonce, m=M, n=N, k=K)
    assert freivalds_check(answer, seed=5, nonce=nonce, m=M, n=N, k=K)
    # The same inputs under another nonce: another product.
    cid2 = secrets.token_hex(16)
    prepare(steps, cid2)
    other = steps.step({"step": "run", "challenge_id": cid2, "nonce": nonce + 1})
    assert other["digest"] != ran["digest"]
    again = str(steps.step({"step": "reveal", "challenge_id": cid2})["answer"])
    assert again != answer and freivalds_check(again, seed=5, nonce=nonce + 1, m=M, n=N, k=K)


def test_steps_out_of_order_or_for_another_challenge_are_refused(steps: GpuChallengeSteps) -> None:
    cid, other = secrets.token_hex(16), secrets.token_hex(16)
    with pytest.raises(StepRefused, match="nothing is prepared here"):
        steps.step({"step": "run", "challenge_id": cid, "nonce": 1})  # a run without a prepare
    prepare(steps, cid)
    with pytest.raises(StepRefused, match=f"the challenge prepared here is {cid}"):
        steps.step({"step": "run", "challenge_id": other, "nonce": 1})
    with pytest.raises(StepRefused, match="its nonce never came"):
        steps.step({"step": "reveal", "challenge_id": cid})  # a reveal before the run
    with pytest.raises(StepRefused, match="integer nonce"):
        steps.step({"step": "run", "challenge_id": cid, "nonce": "7"})
    steps.step({"step": "run", "challenge_id": cid, "nonce": 7})
    with pytest.raises(StepRefused, match="took its nonce already"):
        steps.step({"step": "run", "challenge_id": cid, "nonce": 8})  # a second, stale nonce
    steps.step({"step": "reveal", "challenge_id": cid})
    with pytest.raises(StepRefused, match="nothing is prepared here"):
        steps.step({"step": "reveal", "challenge_id": cid})  # the challenge ended
    with pytest.raises(StepRefused, match="unknown step"):
        steps.step({"step": "answer", "challenge_id": cid})
    with pytest.raises(StepRefused, match="challenge_id"):
        steps.step({"step": "prepare", "challenge_id": "../x", "device": "CPU"})


def test_prepare_bounds_and_a_gpu_name() -> None:
    gpu_only = GpuChallengeSteps(max_side=64, max_k=512, device_name=GPU_DEVICE_NAME, timeout=60)
    base = {"step": "prepare", "challenge_id": "ab" * 16, "seed": 1, "m": 8, "n": 8, "k": 8}
    for bad in ({"device": "CPU"}, {"device": "CUDA0", "k": 513}, {"device": "CUDA0", "m": 0},
                {"device": "CUDA0", "seed": -1}, {"device": "CUDA0", "k": "many"}):  # fmt: skip
        with pytest.raises(StepRefused, match="prepare needs"):
            gpu_only.step({**base, **bad})


def test_a_prepared_challenge_left_idle_is_dropped_with_its_child() -> None:
    children: list[ChallengeChild] = []

    def spawn(request: dict[str, object]) -> ChallengeChild:
        children.append(ChallengeChild(request))
        return children[-1]

    steps = GpuChallengeSteps(max_side=64, max_k=512, device_name=None, timeout=120, idle=0.5,
                              spawn=spawn)  # fmt: skip
    cid = secrets.token_hex(16)
    prepare(steps, cid)
    deadline = time.monotonic() + 30
    while children[0].proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # the watchdog drops it, no step needed
    assert children[0].proc.poll() is not None
    with pytest.raises(StepRefused, match="nothing is prepared here"):
        steps.step({"step": "run", "challenge_id": cid, "nonce": 1})
