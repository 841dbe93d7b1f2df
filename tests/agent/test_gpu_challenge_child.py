"""The GPU challenge's work on the node (issue 25 item 4): agent/runtime/ggml_matmul.py prepares
the seeded inputs on a named device through the build's own ggml, in a child process, and only
the nonce sent afterwards decides the product (B·D·Aᵀ), whose residues hash to the digest it
answered and pass the controller's Freivalds check; a device the build lacks is an error, not a
guess. On lavapipe (Vulkan0) where the Vulkan build is there; the products stay tiny."""

from __future__ import annotations

import base64
import secrets

import pytest

from agent.hardware.gpu_challenge import freivalds_check, reference_answer, residue_digest
from agent.runtime.ggml_matmul import ChallengeChild
from tests.support.lavapipe import LVP_ICD, require_lavapipe


def test_the_product_on_vulkan0_passes_freivalds_and_a_missing_device_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_lavapipe()
    monkeypatch.setenv("VK_ICD_FILENAMES", str(LVP_ICD))
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    seed, nonce, m, n, k = secrets.randbits(63), secrets.randbits(63), 48, 40, 320
    child = ChallengeChild({"device": "Vulkan0", "seed": seed, "m": m, "n": n, "k": k})
    try:
        ready = child.ask(None, timeout=300)
        assert ready.get("ready") is True and ready["device"] == "Vulkan0", ready
        ran = child.ask({"nonce": nonce}, timeout=300)
        assert ran.get("nonce") == nonce, ran
        got = child.ask({"reveal": True}, timeout=300)
    finally:
        child.close()
    assert "answer" in got, got
    assert residue_digest(base64.b64decode(got["answer"]), nonce=nonce) == ran["digest"]
    assert freivalds_check(got["answer"], seed=seed, nonce=nonce, m=m, n=n, k=k)
    # Exact, as designed: the device's product is numpy's.
    assert got["answer"] == reference_answer(seed=seed, nonce=nonce, m=m, n=n, k=k)
    missing = ChallengeChild({"device": "CUDA0", "seed": 1, "m": 4, "n": 4, "k": 4})
    try:
        error = missing.ask(None, timeout=300)
    finally:
        missing.close()
    assert "no device CUDA0" in error.get("error", ""), error
