"""What a core taken from llama-server costs it: a bare llama-server alone, and beside a burner.

Run: ``python bench/lockstep.py [--streams 16] [--pairs 6] [--share 0.2] [--burst-ms 2]``.

RACoN's own processes (daphne, the agent, Celery, Redis) run on the cores the engine uses. This
bench isolates what that costs the engine, without RACoN: one bare llama-server (the agent's
build, bench/concurrency.py's anchor flags), turns of ``--streams`` streamed chats at once (32
tokens each), taken in interleaved pairs: alone, and beside a burner process that keeps one core
busy ``--share`` of the time in bursts of ``--burst-ms`` (as a request's admission, relay and
settlement come in bursts). Printed: the throughput ratio beside the burner against alone, the
engine's CPU per request on both sides, and the burner's CPU per request, so the engine's loss
can be set against the CPU the burner took (docs/design/serving.md, "A core taken from the engine
costs it twice"). Bounded: every turn has a deadline, and both processes are stopped at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import MODEL_NAME, load_average  # noqa: E402
from bench.concurrency import pct, start_anchor, stream_once  # noqa: E402
from tests.e2e.harness import smollm2_path  # noqa: E402

TURN_DEADLINE_SECONDS = 120.0


def burn(share: float, burst: float, stop: Any) -> None:
    """Busy for ``share`` of every period, in bursts of ``burst`` seconds, until ``stop``."""
    period = burst / share
    deadline = time.monotonic() + 600  # bounded even if the parent never says stop
    while not stop.is_set() and time.monotonic() < deadline:
        t = time.perf_counter()
        while time.perf_counter() - t < burst:
            pass
        time.sleep(period - burst)


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def turn(url: str, engine: psutil.Process, *, streams: int, offset: int, share: float, burst: float
         ) -> tuple[float, float, float]:  # fmt: skip
    """One wave of ``streams`` requests: (tokens/s, engine CPU ms a request, burner's)."""
    stop = multiprocessing.Event()
    burner = None
    if share > 0:
        burner = multiprocessing.Process(target=burn, args=(share, burst, stop), daemon=True)
        burner.start()
    tokens: list[int] = []
    errors: list[str] = []
    ready = threading.Event()
    clients = [
        httpx.Client(
            timeout=TURN_DEADLINE_SECONDS, limits=httpx.Limits(max_keepalive_connections=0)
        )
        for _ in range(streams)
    ]

    def one(i: int) -> None:
        ready.wait()
        try:
            tokens.append(stream_once(clients[i], url, "none", offset + i, 32, MODEL_NAME).tokens)
        except Exception as exc:  # a failed request is reported, not counted
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    try:
        for t in threads:
            t.start()
        bp = psutil.Process(burner.pid) if burner is not None and burner.pid else None
        c0, b0 = cpu_seconds(engine), cpu_seconds(bp) if bp else 0.0
        t0 = time.perf_counter()
        ready.set()
        for t in threads:
            t.join(TURN_DEADLINE_SECONDS)
        wall = time.perf_counter() - t0
        c1, b1 = cpu_seconds(engine), cpu_seconds(bp) if bp else 0.0
    finally:
        stop.set()
        if burner is not None:
            burner.join(5)
            if burner.is_alive():
                burner.kill()
        for c in clients:
            c.close()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return sum(tokens) / wall, (c1 - c0) * 1000 / streams, (b1 - b0) * 1000 / streams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--pairs", type=int, default=6, help="interleaved alone/burner pairs")
    p.add_argument("--share", type=float, default=0.2, help="the burner's share of one core")
    p.add_argument("--burst-ms", type=float, default=2.0, help="the burner's burst length")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    for name, ok in (
        ("--streams", 1 <= args.streams <= 64),
        ("--pairs", 1 <= args.pairs <= 50),
        ("--share", 0 < args.share < 1),
        ("--burst-ms", 0.1 <= args.burst_ms <= 100),
        ("--threads", 1 <= args.threads <= 64),
    ):
        if not ok:
            p.error(f"{name} is out of range")
    from agent.runtime.server import find_llama_server

    workdir = Path(tempfile.mkdtemp(prefix="racon-lockstep-"))
    print(
        f"== lockstep: llama-server alone vs beside a burner ({args.share:.0%} of one core in "
        f"{args.burst_ms:g} ms bursts), {args.streams} streams x 32 tokens, {args.threads} "
        f"threads, {args.pairs} pairs; {load_average()} ==",
        flush=True,
    )
    proc, base = start_anchor(
        find_llama_server(),
        smollm2_path(),
        slots=max(args.streams, 4),
        n_ctx=512,
        threads=args.threads,
        log_path=workdir / "llama-server.log",
    )
    try:
        url = base + "/v1/chat/completions"
        engine = psutil.Process(proc.pid)
        turn(url, engine, streams=4, offset=0, share=0, burst=0)  # warm up
        sides: dict[str, list[tuple[float, float, float]]] = {"alone": [], "burner": []}
        for k in range(args.pairs):
            order = ("alone", "burner") if k % 2 == 0 else ("burner", "alone")
            for side in order:
                share = args.share if side == "burner" else 0.0
                sides[side].append(
                    turn(
                        url,
                        engine,
                        streams=args.streams,
                        offset=100 * k,
                        share=share,
                        burst=args.burst_ms / 1000,
                    )  # fmt: skip
                )
        ratios = [b[0] / a[0] for a, b in zip(sides["alone"], sides["burner"], strict=True)]
        a_tps = statistics.median(r[0] for r in sides["alone"])
        b_tps = statistics.median(r[0] for r in sides["burner"])
        a_cpu = statistics.median(r[1] for r in sides["alone"])
        b_cpu = statistics.median(r[1] for r in sides["burner"])
        burner_cpu = statistics.median(r[2] for r in sides["burner"])
        print(
            f"[{args.streams} streams] beside the burner {b_tps:.1f} tok/s, alone {a_tps:.1f} "
            f"tok/s: {statistics.median(ratios):.2f}x (p10 {pct(ratios, 0.1):.2f}, "
            f"p90 {pct(ratios, 0.9):.2f}, {args.pairs} pairs)"
        )
        fair = a_cpu / (a_cpu + burner_cpu)
        print(
            f"    CPU ms/request: engine alone {a_cpu:.1f}, beside the burner {b_cpu:.1f}; "
            f"burner {burner_cpu:.1f}. Were the burner's CPU all the engine lost, the ratio "
            f"would be {fair:.2f}x"
        )
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except Exception:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"== done; {load_average()} ==")


if __name__ == "__main__":
    main()
