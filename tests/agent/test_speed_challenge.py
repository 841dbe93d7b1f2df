"""The CPU speed challenge's chain has no powering shortcut (issue 25): the affine GF(3) chain
it replaced could be computed from B's powers; the non-linear one cannot."""

from __future__ import annotations

import hashlib

import numpy as np

from agent.hardware.benchmark import speed_challenge_digest


def _inputs(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, size=(n, n)).astype(np.float32)
    b = rng.integers(-1, 2, size=(n, n)).astype(np.float32)
    return x, b


def _digest(x: np.ndarray) -> str:
    return hashlib.sha256(x.astype(np.int8).tobytes()).hexdigest()


def affine_chain_digest(seed: int, n: int, reps: int) -> str:
    """The chain the challenge used before: X(i+1) = (Xi @ B) mod 3 - 1, step by step."""
    x, b = _inputs(seed, n)
    for _ in range(reps):
        x = np.remainder(x @ b, 3.0) - 1.0
    return _digest(x)


def powering_shortcut_digest(seed: int, n: int, reps: int) -> str:
    """X(reps) = X0·B^reps - J·(I + B + ... + B^(reps-1)) mod 3, from O(log reps) products."""
    x, b = _inputs(seed, n)
    x0, bm = x.astype(np.int64) % 3, b.astype(np.int64) % 3
    eye = np.eye(n, dtype=np.int64)
    power, total = eye.copy(), np.zeros((n, n), dtype=np.int64)  # B^k and I + ... + B^(k-1)
    base_power, base_total = bm.copy(), eye.copy()  # for k = 2^i
    k = reps
    while k:
        if k & 1:
            total = (total + base_total @ power) % 3  # sums compose: S(a+b) = S(a) + S(b)·B^a
            power = (power @ base_power) % 3
        base_total = (base_total + base_total @ base_power) % 3
        base_power = (base_power @ base_power) % 3
        k >>= 1
    ones = np.ones((n, n), dtype=np.int64)
    residue = (x0 @ power - ones @ total) % 3
    value = (residue + 1) % 3 - 1  # the chain's representatives: -1, 0, 1
    return _digest(value.astype(np.float32))


def test_the_powering_shortcut_reproduces_the_old_affine_chain() -> None:
    for seed, reps in ((7, 1), (11, 37), (12345, 64)):
        assert powering_shortcut_digest(seed, 48, reps) == affine_chain_digest(seed, 48, reps)


def test_the_powering_shortcut_gives_a_wrong_digest_for_the_challenge_chain() -> None:
    for seed, reps in ((7, 1), (11, 37), (12345, 64)):
        honest = speed_challenge_digest(seed=seed, n=48, reps=reps)
        assert powering_shortcut_digest(seed, 48, reps) != honest
        assert affine_chain_digest(seed, 48, reps) != honest


def test_the_chain_does_not_settle_into_a_fixed_point() -> None:
    # A chain that collapsed to a constant matrix would have a digest without the work.
    digests = {speed_challenge_digest(seed=3, n=32, reps=r) for r in range(40, 48)}
    assert len(digests) == 8
