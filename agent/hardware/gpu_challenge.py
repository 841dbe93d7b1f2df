"""The GPU speed challenge's arithmetic (issue 25): a matrix product the node computes on one GPU
through its own llama.cpp build, and the controller checks with Freivalds' algorithm.

Shared by both sides (pure numpy, no ggml). The challenge has two phases
(apps/nodes/gpu_challenges.py has the protocol):

1. prepare, untimed: the node builds A (n×k) and B (m×k) from the controller's seed and puts them
   on the device (agent/runtime/ggml_matmul.py);
2. run, timed: the controller sends a fresh nonce only then; the nonce gives a diagonal D
   (``nonce_scale``), and the node computes ``C = B·D·Aᵀ`` on the device and answers a digest of
   ``C mod P`` (``residue_digest``) at once; the residues themselves follow untimed, and the
   controller checks that they are the ones the digest committed to, and, with Freivalds'
   algorithm, that they are the product: ``C·r ≡ B·(D·(Aᵀ·r)) (mod P)`` for random vectors r, in
   O(k·(m+n)) instead of the product's O(m·n·k). A wrong answer passes one round with probability
   at most 1/P.

Why the nonce makes the work unskippable: C = Σᵢ dᵢ·bᵢ·aᵢᵀ is a sum of k rank-one terms whose
weights exist only once the nonce arrives. Nothing computed during prepare (A·Bᵀ, or the product
for any guessed D₀) saves more than the terms whose weight the guess got right, 1/(2·SCALE_MAX)
of them on average, and the digest binds the node to one product before the clock stops.

Why these numbers:
- A and B in {-1, 0, 1}, D in ±{1..SCALE_MAX}: every product and partial sum is an integer of at
  most SCALE_MAX·k = 2^21 within the agent's bounds, exact in float32 (2^24), and A·D's entries
  are exact in float16 and TF32 too, so whatever type or accumulation order a backend uses
  (cuBLAS, Vulkan's shaders, Metal) the product is exactly the integer matrix: one answer;
- the answer modulo a prime below 256: one byte per entry, so a 1024×1024 answer is 1 MiB and fits
  a report, and Freivalds' check works in the field of that prime;
- seed and nonce are fresh per challenge, so no answer can be computed before the nonce arrives.
"""

from __future__ import annotations

import base64
import hashlib
import secrets

import numpy as np

PRIME = 251
ROUNDS = 4  # Freivalds rounds: a wrong answer passes all with probability at most P**-4
SCALE_MAX = 32  # D's entries: ±1 … ±SCALE_MAX, never 0


def challenge_flops(*, m: int, n: int, k: int) -> float:
    """Floating-point operations of the product (a multiply and an add per term)."""
    return 2.0 * m * n * k


def challenge_inputs(*, seed: int, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A (n×k) and B (m×k), int8 in {-1, 0, 1}, from the seed (the same on both sides)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(-1, 2, size=(n, k), dtype=np.int8)
    b = rng.integers(-1, 2, size=(m, k), dtype=np.int8)
    return a, b


def nonce_scale(*, nonce: int, k: int) -> np.ndarray:
    """D's diagonal from the nonce: k int8 entries, uniform over ±1 … ±SCALE_MAX."""
    rng = np.random.Generator(np.random.PCG64(nonce))
    magnitude = rng.integers(1, SCALE_MAX + 1, size=k, dtype=np.int8)
    sign = rng.integers(0, 2, size=k, dtype=np.int8) * 2 - 1
    return (magnitude * sign).astype(np.int8)


def residues(product: np.ndarray) -> bytes:
    """The device's float product as residues: each entry rounded, mod PRIME, one byte each."""
    exact = np.rint(product).astype(np.int64)
    return np.mod(exact, PRIME).astype(np.uint8).tobytes()


def answer_encode(product: np.ndarray) -> str:
    """The residues as the wire answer (base64)."""
    return base64.b64encode(residues(product)).decode()


def residue_digest(raw: bytes, *, nonce: int) -> str:
    """The timed answer: sha256 over the nonce and the residues (hex)."""
    return hashlib.sha256(b"racon-gpu-challenge:%d:" % nonce + raw).hexdigest()


def answer_decode(answer: str, *, m: int, n: int) -> np.ndarray | None:
    """The answer as an m×n matrix of residues, or None when it is not one."""
    try:
        raw = base64.b64decode(answer, validate=True)
    except (ValueError, TypeError):
        return None
    if len(raw) != m * n:
        return None
    return np.frombuffer(raw, dtype=np.uint8).reshape(m, n)


def reference_product(*, seed: int, nonce: int, m: int, n: int, k: int) -> np.ndarray:
    """B·D·Aᵀ computed here with numpy, in float32 as a device does (tests, the device check)."""
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    d = nonce_scale(nonce=nonce, k=k).astype(np.float32)
    return b.astype(np.float32) @ (a.astype(np.float32) * d).T


def reference_answer(*, seed: int, nonce: int, m: int, n: int, k: int) -> str:
    """The answer computed here with numpy."""
    return answer_encode(reference_product(seed=seed, nonce=nonce, m=m, n=n, k=k))


def freivalds_check(
    answer: str, *, seed: int, nonce: int, m: int, n: int, k: int, rounds: int = ROUNDS
) -> bool:
    """Whether ``answer`` is B·D·Aᵀ mod PRIME for the seed's A and B and the nonce's D, by
    Freivalds' algorithm."""
    got = answer_decode(answer, m=m, n=n)
    if got is None:
        return False
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    # int32 is exact here, every sum reduced mod PRIME before the next product: at most
    # n·PRIME², SCALE_MAX·PRIME or k·PRIME, far from 2**31 within the agent's bounds; and half
    # int64's memory (the inputs are the controller's large allocation).
    d = np.mod(nonce_scale(nonce=nonce, k=k).astype(np.int32), PRIME)
    c = got.astype(np.int32)
    a32, b32 = a.astype(np.int32), b.astype(np.int32)
    for _ in range(rounds):
        # The controller's own randomness, drawn after the answer arrived.
        r = np.array([secrets.randbelow(PRIME) for _ in range(n)], dtype=np.int32)
        left = np.mod(c @ r, PRIME)
        scaled = np.mod(d * np.mod(a32.T @ r, PRIME), PRIME)
        right = np.mod(b32 @ scaled, PRIME)
        if not np.array_equal(left, right):
            return False
    return True
