"""Short compute and memory-bandwidth benchmarks, cached per hardware fingerprint.

The scheduler weighs devices by these two figures, so they must be comparable across nodes
(same code, same sizes) and cheap enough to run at every first start (about one second).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("agent.hardware.benchmark")
CACHE_FILE = "benchmark.json"
# How the cached figures were measured: an entry of another method is measured again. 2: the
# compute figure is never below one BLAS thread's (1: every core at once, however busy).
METHOD = 2
# numpy's BLAS reads its thread count from these when it loads (OpenBLAS, OpenMP builds, MKL).
_ONE_THREAD = {v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def measure_gflops(budget_s: float = 0.5) -> float:
    """float32 matmul throughput of numpy's BLAS on this machine, in GFLOPS."""
    try:
        import numpy as np  # noqa: PLC0415 - optional: no dependency brings it
    except ImportError:
        return _python_gflops(budget_s)
    n = 512
    rng = np.random.default_rng(0)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    np.matmul(a, b)  # warm up BLAS threads and caches
    flops_per = 2.0 * n * n * n
    runs, start = 0, time.perf_counter()
    while True:
        np.matmul(a, b)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s or runs >= 10_000:
            break
    return round(flops_per * runs / elapsed / 1e9, 2)


def _python_gflops(budget_s: float) -> float:
    # Without numpy the figure is only a rough relative rank, never a peak.
    x, runs, start = 1.0001, 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        for _ in range(10_000):
            x = x * 1.0000001 + 0.0000001
        runs += 1
    return round(runs * 20_000 / (time.perf_counter() - start) / 1e9, 4)


def measure_mem_bandwidth(budget_s: float = 0.5, size_mb: int = 64) -> float:
    """Large array copy throughput (bytes read + written), in GB/s."""
    try:
        import numpy as np  # noqa: PLC0415 - optional: no dependency brings it
    except ImportError:
        return _python_bandwidth(budget_s, size_mb)
    n = size_mb * 1024 * 1024 // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    runs, start = 0, time.perf_counter()
    while True:
        np.copyto(dst, src)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s or runs >= 1000:
            break
    return round(2 * src.nbytes * runs / elapsed / 1e9, 2)


def _python_bandwidth(budget_s: float, size_mb: int) -> float:
    src = bytearray(size_mb * 1024 * 1024)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        _ = bytes(src)
        runs += 1
    return round(2 * len(src) * runs / (time.perf_counter() - start) / 1e9, 2)


CHALLENGE_N = 512  # the same matrix size as measure_gflops, so an honest claim times the same


def speed_challenge_flops(*, n: int, reps: int) -> float:
    """Floating-point operations a speed challenge of this size costs."""
    return 2.0 * n * n * n * reps


# The chain's non-linear step: each product reduced mod 5, then mod 3. Over the integers the
# products are exact in float32 (|value| <= n), but the two moduli do not compose into one
# linear map, so X(reps) has no closed form in B's powers.
CHALLENGE_MOD = 5.0


def speed_challenge_digest(*, seed: int, n: int, reps: int) -> str:
    """The answer to a speed challenge: sha256 of the last matrix of a chain of ``reps`` matmuls.

    X0 and B hold entries in {-1, 0, 1} drawn from ``seed``; X(i+1) = ((Xi @ B) mod 5) mod 3 - 1.
    Every product is an integer of magnitude at most n, which float32 holds exactly, so any BLAS
    gives the same bits, and each step needs the one before it. The step is deliberately not
    affine: the earlier (Xi @ B) mod 3 - 1 was affine over GF(3), so X(reps) followed from about
    2·log2(reps) products by powering B (13x faster than the chain, reproduced outside the
    project; tests/agent/test_speed_challenge.py shows that shortcut now misses). The controller
    times the round trip and recomputes the chain to check the answer.
    """
    # The agent's llama.cpp extra brings numpy; only a challenged node needs it.
    import numpy as np  # noqa: PLC0415 - optional: the [agent] extra (llama-cpp-python) brings it

    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, size=(n, n)).astype(np.float32)
    b = rng.integers(-1, 2, size=(n, n)).astype(np.float32)
    for _ in range(reps):
        x = np.remainder(np.remainder(x @ b, CHALLENGE_MOD), 3.0) - 1.0
    return hashlib.sha256(x.astype(np.int8).tobytes()).hexdigest()


def measure_thread_gflops(budget_s: float = 0.5) -> float:
    """One BLAS thread's matmul rate, in GFLOPS (0.0 when it cannot be measured):
    ``measure_gflops`` in a child process whose BLAS loads with one thread (the count is fixed
    when numpy loads, so it cannot be this process)."""
    code = "import sys; from agent.hardware.benchmark import measure_gflops as m; print(m(float(sys.argv[1])))"
    env = {**os.environ, **_ONE_THREAD, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(budget_s)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60 + budget_s,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("the one-thread compute benchmark failed: %s", exc)
        return 0.0


def run_benchmarks() -> dict[str, float]:
    """The node's compute claim and its memory bandwidth (one thread's copy).

    The compute claim is every core's matmul rate, but never less than one thread's: every core
    timed at once collapses when one of them is busy with anything else (BLAS threads wait for
    the slowest), and the figure is measured once and cached. A 2-core machine with one core
    busy measured 16.9 GFLOPS on both cores against 191 idle (one thread: about 140 either way),
    and the scheduler then under-predicted a node lending one thread by 4x (tests/cluster
    test_multihost (b) under ``make test-load``).
    """
    return {"gflops": measure_claim_gflops(), "mem_bandwidth_gbps": measure_mem_bandwidth()}


def measure_claim_gflops(budget_s: float = 0.5) -> float:
    """The compute claim: every core's matmul rate, never below one thread's (run_benchmarks)."""
    every, one = measure_gflops(budget_s), measure_thread_gflops(budget_s)
    if one > every:
        log.info("compute: %s GFLOPS on every core, below one thread's %s: a busy core", every, one)
    return max(every, one)


def cached_benchmarks(
    state_dir: Path,
    fingerprint: str,
    *,
    runner: Callable[[], dict[str, float]] = run_benchmarks,
) -> dict[str, float]:
    """Benchmarks for this fingerprint: from the cache, else measured once and stored."""
    path = state_dir / CACHE_FILE
    cache: dict[str, Any] = {}
    try:
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict):
            cache = loaded
    except (OSError, ValueError):
        pass
    hit = cache.get(fingerprint)
    if (
        isinstance(hit, dict)
        and hit.get("method") == METHOD
        and {"gflops", "mem_bandwidth_gbps"} <= hit.keys()
    ):
        return {
            "gflops": float(hit["gflops"]),
            "mem_bandwidth_gbps": float(hit["mem_bandwidth_gbps"]),
        }
    log.info("running compute and memory benchmarks (about 1 s)")
    result = runner()
    # Only the current machine matters; a stale fingerprint is dropped rather than kept forever.
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    entry = {**result, "method": METHOD, "measured_at": time.time()}
    tmp.write_text(json.dumps({fingerprint: entry}, indent=2))
    tmp.replace(path)
    return result
