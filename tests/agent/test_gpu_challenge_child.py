"""The GPU challenge's work on the node (issue 25 item 4): agent/runtime/ggml_matmul.py computes
the seeded product on a named device through the build's own ggml, in a child process, and the
answer passes the controller's Freivalds check; a device the build lacks is an error, not a
guess. On lavapipe (Vulkan0) where the Vulkan build is there; the products stay tiny."""

from __future__ import annotations

import secrets

import pytest

from agent.hardware.gpu_challenge import freivalds_check, reference_answer
from agent.runtime.ggml_matmul import run_child
from tests.support.lavapipe import LVP_ICD, require_lavapipe


def test_the_product_on_vulkan0_passes_freivalds_and_a_missing_device_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_lavapipe()
    monkeypatch.setenv("VK_ICD_FILENAMES", str(LVP_ICD))
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    seed, m, n, k = secrets.randbits(63), 48, 40, 320
    got = run_child({"device": "Vulkan0", "seed": seed, "m": m, "n": n, "k": k}, timeout=300)
    assert "answer" in got, got
    assert freivalds_check(got["answer"], seed=seed, m=m, n=n, k=k)
    assert got["answer"] == reference_answer(seed=seed, m=m, n=n, k=k)  # exact, as designed
    missing = run_child({"device": "CUDA0", "seed": 1, "m": 4, "n": 4, "k": 4}, timeout=300)
    assert "no device CUDA0" in missing.get("error", ""), missing
