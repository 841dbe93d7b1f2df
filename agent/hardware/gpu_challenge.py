"""The GPU speed challenge's arithmetic (issue 25): a matrix product the node computes on one GPU
through its own llama.cpp build, and the controller checks with Freivalds' algorithm.

Shared by both sides (pure numpy, no ggml): the agent's child (agent/runtime/ggml_matmul.py)
builds the inputs from the seed, computes ``C = B·Aᵀ`` on the device and answers ``C mod P`` as
bytes; the controller (apps/nodes/gpu_challenges.py) rebuilds A and B from the same seed and
checks ``C·r ≡ B·(Aᵀ·r) (mod P)`` for random vectors r, in O(k·(m+n)) instead of the product's
O(m·n·k). A wrong answer passes one round with probability at most 1/P.

Why these numbers:
- entries in {-1, 0, 1}: every product and partial sum is a small integer, exact in float32,
  float16 and bfloat16 alike, so whatever type or accumulation order a backend uses (cuBLAS,
  Vulkan's shaders, Metal) the product is exactly the integer matrix, and the answer is one value;
- the answer modulo a prime below 256: one byte per entry, so a 1024×1024 answer is 1 MiB and fits
  a report, and Freivalds' check works in the field of that prime;
- the seed is fresh per challenge, so no answer can be computed before the command arrives.
"""

from __future__ import annotations

import base64
import secrets

import numpy as np

PRIME = 251
ROUNDS = 4  # Freivalds rounds: a wrong answer passes all with probability at most P**-4


def challenge_flops(*, m: int, n: int, k: int) -> float:
    """Floating-point operations of the product (a multiply and an add per term)."""
    return 2.0 * m * n * k


def challenge_inputs(*, seed: int, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A (n×k) and B (m×k), int8 in {-1, 0, 1}, from the seed (the same on both sides)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(-1, 2, size=(n, k), dtype=np.int8)
    b = rng.integers(-1, 2, size=(m, k), dtype=np.int8)
    return a, b


def answer_encode(product: np.ndarray) -> str:
    """The device's float product as the wire answer: each entry rounded, mod PRIME, one byte."""
    exact = np.rint(product).astype(np.int64)
    return base64.b64encode(np.mod(exact, PRIME).astype(np.uint8).tobytes()).decode()


def answer_decode(answer: str, *, m: int, n: int) -> np.ndarray | None:
    """The answer as an m×n matrix of residues, or None when it is not one."""
    try:
        raw = base64.b64decode(answer, validate=True)
    except (ValueError, TypeError):
        return None
    if len(raw) != m * n:
        return None
    return np.frombuffer(raw, dtype=np.uint8).reshape(m, n)


def reference_answer(*, seed: int, m: int, n: int, k: int) -> str:
    """The answer computed here with numpy (tests and the device check's CPU side)."""
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    return answer_encode(b.astype(np.float32) @ a.astype(np.float32).T)


def freivalds_check(
    answer: str, *, seed: int, m: int, n: int, k: int, rounds: int = ROUNDS
) -> bool:
    """Whether ``answer`` is B·Aᵀ mod PRIME for the seed's A and B, by Freivalds' algorithm."""
    got = answer_decode(answer, m=m, n=n)
    if got is None:
        return False
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    # int32 is exact here (every sum is below n·PRIME² or k·PRIME, far from 2**31 within the
    # agent's bounds) and half int64's memory: the inputs are the controller's large allocation.
    c = got.astype(np.int32)
    a32, b32 = a.astype(np.int32), b.astype(np.int32)
    for _ in range(rounds):
        # The controller's own randomness, drawn after the answer arrived.
        r = np.array([secrets.randbelow(PRIME) for _ in range(n)], dtype=np.int32)
        left = np.mod(c @ r, PRIME)
        right = np.mod(b32 @ np.mod(a32.T @ r, PRIME), PRIME)
        if not np.array_equal(left, right):
            return False
    return True
