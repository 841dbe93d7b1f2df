"""Concurrency benchmark: RACoN against llama.cpp's own llama-server, side by side in one run.

Run: ``python bench/concurrency.py [--threads 2] [--slots 32] [--max-tokens 64] [--pairs 5] [--quick]``.

Both sides serve the same GGUF (SmolLM2) with the same llama-server build (the one the agent
runs), the same slot count (-np), per-slot context, threads and batch size. RACoN runs as in
production: OpenAI request -> daphne -> admission -> Redis -> node agent -> llama-server ->
Redis stream -> SSE. The anchor is a bare llama-server started here, called on its own
/v1/chat/completions. Clients are threads streaming chat completions through httpx with
`stream_options.include_usage`, so both sides count completion tokens the same way.

For each concurrency level (1, 4, 8, 16, 32 streams) the two sides take turns in `--pairs` (5)
interleaved pairs (A/B, B/A, ...), each turn running `2 x streams` requests with `streams` at a
time (`--quick`: one wave of `streams` requests, 32 tokens each, so a run stays within minutes on
a shared machine); aggregate tokens/s is completion tokens over the turn's wall time. Printed: the
single-stream decode ratio and the aggregate ratios (the median over the pairs, with p10 and p90),
TTFT p50 and p90 of both sides, where each turn's CPU went per request (the engine on both sides,
RACoN's daphne, Celery, agent and Redis; a RACoN turn is followed by its settlement, counted with
it, before the next turn starts), and (with two agents) how routing by free slots spread 32 requests over
two replicas. Everything runs on loopback, is bounded in count and time, and is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import MODEL_NAME, CpuMeter, load_average, local_cluster  # noqa: E402
from tests.e2e.harness import free_port, wait_for  # noqa: E402

GOAL_SINGLE = 0.95
GOAL_AGGREGATE = 0.9
GOAL_TTFT_EXTRA_MS = 50.0
GOAL_SPREAD = 0.30
TOPICS = [
    "a lighthouse keeper", "a robot painter", "a city on a turtle", "two rival bakers",
    "a self-drawing map", "a weather violinist", "the last library on the moon", "a cat postmaster",
]  # fmt: skip


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]


@dataclass
class Result:
    ttft_ms: float
    tokens: int
    seconds: float
    deployment: str = ""


@dataclass
class Turn:
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0
    errors: list[str] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU-s per process group in the turn

    @property
    def aggregate(self) -> float:
        return sum(r.tokens for r in self.results) / self.wall if self.wall else 0.0


def stream_once(
    client: httpx.Client, url: str, key: str, i: int, max_tokens: int, model: str
) -> Result:
    body = {
        "model": model, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    with connect_sse(
        client, "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as events:
        resp = events.response
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        dep = resp.headers.get("X-Racon-Deployment-Id", "")
        for event in events.iter_sse():
            if event.data == "[DONE]":
                continue
            obj = json.loads(event.data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            choices = obj.get("choices") or []
            if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                ttft = (time.perf_counter() - t0) * 1000
            if obj.get("usage"):
                tokens = int(obj["usage"]["completion_tokens"])
    return Result(
        ttft_ms=ttft or 0.0, tokens=tokens, seconds=time.perf_counter() - t0, deployment=dep
    )


def run_turn(
    url: str, key: str, *, streams: int, requests: int, max_tokens: int, model: str, offset: int
) -> Turn:
    """`requests` streamed chats, `streams` at a time; bounded by count and by a 300 s deadline."""
    turn = Turn()
    lock = threading.Lock()
    next_i = [0]
    deadline = time.monotonic() + 300

    def worker() -> None:
        # One client per stream, made before the clock starts (a client builds an SSL context:
        # tens of ms), and a new connection per request on both sides (no keep-alive): llama-server
        # closes idle keep-alive connections, and a reused dead one would count as an error.
        with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            ready.wait()
            while time.monotonic() < deadline:
                with lock:
                    i = next_i[0]
                    if i >= requests:
                        return
                    next_i[0] += 1
                try:
                    r = stream_once(client, url, key, offset + i, max_tokens, model)
                except Exception as exc:  # counted and printed, never hidden
                    with lock:
                        turn.errors.append(str(exc)[:200])
                    continue
                with lock:
                    turn.results.append(r)

    ready = threading.Event()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # every worker has built its client
    t0 = time.perf_counter()
    ready.set()
    for t in threads:
        t.join(330)
    turn.wall = time.perf_counter() - t0
    return turn


def level_turn(
    url: str, key: str, args: argparse.Namespace, *, streams: int, requests: int, offset: int
) -> Turn:
    """One turn of a level: `--quick` caps a request at 32 tokens."""
    return run_turn(
        url,
        key,
        streams=streams,
        requests=requests,
        max_tokens=min(args.max_tokens, 32) if args.quick else args.max_tokens,
        model=MODEL_NAME,
        offset=offset,
    )


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def start_anchor(
    server: Path, model: Path, *, slots: int, n_ctx: int, threads: int, log_path: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """A bare llama-server of the same build: same slots, per-slot context, threads, batch and
    memory flags as the agent's, with llama.cpp's own defaults for everything else (thread polling
    included, which the agent turns off)."""
    port = free_port()
    argv = [
        str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(n_ctx * slots), "--no-kv-unified", "-t", str(threads), "-tb", str(threads),
        "-ngl", "0", "-b", "512", "--jinja", "--no-webui", "--cont-batching", "-fa", "auto",
        "--fit", "off", "--cache-ram", "0",
    ]  # fmt: skip
    logf = open(log_path, "wb")  # closed with the process
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"llama-server exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
            )
        try:
            return httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 120, "llama-server (anchor) to load", interval=0.2)
    return proc, base


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=32, help="-np on both sides (>= the top level)")
    p.add_argument("--n-ctx", type=int, default=512, help="context per slot")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--levels", default="1,4,8,16,32")
    p.add_argument("--pairs", type=int, default=5, help="interleaved A/B pairs per level")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one wave of requests per turn (streams at a time, 32 tokens), no replica part: "
        "bounded time on a shared machine; the pairs stay",
    )
    p.add_argument("--no-replicas", action="store_true")
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    from agent.runtime.server import find_llama_server

    server = find_llama_server()
    n_agents = 1 if (args.quick or args.no_replicas) else 2
    print(
        f"== concurrency: RACoN vs llama-server ({server.parent.parent.name}), SmolLM2, "
        f"{args.slots} slots x {args.n_ctx} ctx, {args.threads} threads, "
        f"{args.max_tokens}-token streamed chats; {load_average()} ==",
        flush=True,
    )
    with local_cluster(
        n_agents, benchmark=False, cores=args.threads, log=lambda s: print(s, flush=True)
    ) as cl:
        dep = cl.deploy([cl.node_names[0]], n_ctx=args.n_ctx, n_parallel=args.slots)
        racon_url = cl.ctl.url + "/v1/chat/completions"
        anchor, base = start_anchor(
            server,
            cl.model_path,
            slots=args.slots,
            n_ctx=args.n_ctx,
            threads=args.threads,
            log_path=cl.workdir / "anchor.log",
        )
        anchor_url = base + "/v1/chat/completions"
        meters = {
            "racon": stack_meter(cl),
            "llama-server": CpuMeter({"engine": [anchor.pid]}, set()),
        }
        try:
            # Warm both (first requests page weights in and compile the template).
            run_turn(
                racon_url,
                cl.ctl.api_key,
                streams=2,
                requests=4,
                max_tokens=8,
                model=MODEL_NAME,
                offset=0,
            )
            run_turn(
                anchor_url, "none", streams=2, requests=4, max_tokens=8, model=MODEL_NAME, offset=0
            )
            rows: dict[int, dict[str, list[Turn]]] = {}
            for streams in levels:
                n_req = 2 * streams if streams > 1 else 6
                if args.quick:
                    n_req = streams if streams > 1 else 3
                sides: dict[str, list[Turn]] = {"racon": [], "llama-server": []}
                # A/B, B/A, A/B ...: each pair is measured back to back, the order alternating so
                # that neither side always runs after the other (the machine's load drifts).
                order = [
                    side
                    for k in range(args.pairs)
                    for side in (
                        ("racon", "llama-server") if k % 2 == 0 else ("llama-server", "racon")
                    )
                ]
                for k, side in enumerate(order):
                    url, key = (
                        (racon_url, cl.ctl.api_key) if side == "racon" else (anchor_url, "none")
                    )
                    before = meters[side].read()
                    turn = level_turn(
                        url, key, args, streams=streams, requests=n_req, offset=100 * k
                    )
                    if side == "racon":
                        settled_wait(cl)
                    after = meters[side].read()
                    turn.cpu = {g: after[g] - before[g] for g in after}
                    sides[side].append(turn)
                rows[streams] = sides
                report_level(streams, sides)
            if n_agents == 2:
                spread(cl, dep, args)
        finally:
            anchor.terminate()
            try:
                anchor.wait(10)
            except subprocess.TimeoutExpired:
                anchor.kill()
    print(f"== done; {load_average()} ==", flush=True)
    return 0


def report_level(streams: int, sides: dict[str, list[Turn]]) -> None:
    """Aggregate tokens/s: the median of each side's turns, and the ratio of each A/B pair (the
    turns taken back to back) with its median, p10 and p90. TTFT p50 over every request."""

    def agg(side: str) -> float:
        return statistics.median(t.aggregate for t in sides[side])

    def ttfts(side: str) -> list[float]:
        return [r.ttft_ms for t in sides[side] for r in t.results]

    errors = sum(len(t.errors) for s in sides.values() for t in s)
    pairs = [
        a.aggregate / b.aggregate
        for a, b in zip(sides["racon"], sides["llama-server"], strict=False)
        if b.aggregate
    ]
    ratio = statistics.median(pairs) if pairs else float("nan")
    rt, lt = ttfts("racon"), ttfts("llama-server")
    goal = GOAL_SINGLE if streams == 1 else GOAL_AGGREGATE
    verdict = "PASS" if ratio >= goal else "FAIL"
    label = "single stream decode" if streams == 1 else f"{streams:>2} streams aggregate"
    print(
        f"[{label}] RACoN {agg('racon'):6.1f} tok/s, "
        f"llama-server {agg('llama-server'):6.1f} tok/s: {ratio:.2f}x "
        f"(p10 {pct(pairs, 0.1):.2f}, p90 {pct(pairs, 0.9):.2f}, {len(pairs)} pairs)  "
        f"[goal >= {goal}]  {verdict}"
    )
    extra = pct(rt, 0.5) - pct(lt, 0.5)
    line = (f"    TTFT p50 RACoN {pct(rt, 0.5):7.1f} ms vs {pct(lt, 0.5):7.1f} ms (+{extra:.1f} ms); "
            f"p90 {pct(rt, 0.9):7.1f} ms vs {pct(lt, 0.9):7.1f} ms")  # fmt: skip
    if streams in (1, 8):
        line += (
            f"  [goal p50 <= llama-server + {GOAL_TTFT_EXTRA_MS:.0f} ms]  "
            f"{'PASS' if extra <= GOAL_TTFT_EXTRA_MS else 'FAIL'}"
        )
    print(line + (f"  errors: {errors}" if errors else ""), flush=True)
    # Each turn's figure, in the order run: one slow turn (the shared machine) shows here.
    print(
        "    turns tok/s: "
        + "; ".join(
            f"{side} " + ", ".join(f"{t.aggregate:.1f}" for t in sides[side]) for side in sides
        )
        + "; slowest request: "
        + ", ".join(
            f"{side} {max((r.seconds for t in sides[side] for r in t.results), default=0):.1f} s"
            for side in sides
        ),
        flush=True,
    )
    print(cpu_line(streams, sides), flush=True)
    for side in sides:
        for t in sides[side]:
            for e in t.errors[:2]:
                print(f"    {side} error: {e}")


def settled_wait(cl: Any, timeout: float = 15.0) -> None:
    """Until the turn's settlement has run (apps/jobs/settle_queue.py: nothing queued, no batch on
    its way), at most ``timeout``: work deferred past a RACoN turn is counted in its CPU, and does
    not run in the next turn, which may be llama-server's."""
    from apps.jobs.settle_queue import settle_idle

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if settle_idle():
            return
        time.sleep(0.05)
    print(f"    (settlement still running {timeout:.0f} s after the turn)", flush=True)


def stack_meter(cl: Any) -> CpuMeter:
    """RACoN's processes in groups: the engine (each agent's llama-server), daphne (every
    process of the server layer), Celery (worker, pool and beat), the agents themselves, and the
    embedded Redis (not counted when the bench runs on a shared REDIS_URL)."""
    import psutil

    agents = [a.proc.pid for a in cl.agents]
    engines = [
        c.pid
        for pid in agents
        for c in psutil.Process(pid).children(recursive=True)
        if c.name() == "llama-server"
    ]
    return CpuMeter(
        {
            "engine": engines,
            "daphne": [p.pid for p in cl.ctl.procs],
            "celery": [cl.ctl.worker.pid],
            "agent": agents,
            "redis": [cl.env.embedded.process.pid] if cl.env.embedded is not None else [],
        },
        children={"celery"},
    )


def cpu_line(streams: int, sides: dict[str, list[Turn]]) -> str:
    """Where the CPU of a turn went (medians over the turns), in CPU-ms per request: the
    engine on each side, and RACoN's own stack by process. On two cores a turn saturates the
    machine from a few streams on, so every ms the stack takes is a ms the engine does not get.
    Counted over each turn and, for RACoN, until its settlement has run (settled_wait)."""

    def per_request(side: str, group: str) -> float:
        return statistics.median(
            1000 * t.cpu.get(group, 0.0) / max(1, len(t.results)) for t in sides[side]
        )

    groups = ("daphne", "celery", "agent", "redis")
    stack = sum(per_request("racon", g) for g in groups)
    return (
        f"    CPU ms/request: llama-server alone {per_request('llama-server', 'engine'):.1f}; "
        f"RACoN engine {per_request('racon', 'engine'):.1f} + stack {stack:.1f} ("
        + ", ".join(f"{g} {per_request('racon', g):.1f}" for g in groups)
        + f"); {streams} streams, medians over the turns"
    )


def spread(cl: Any, dep: dict[str, Any], args: argparse.Namespace) -> None:
    """A second replica on the other agent; 32 requests, 8 at a time: who served what."""
    second = cl.deploy(
        [cl.node_names[1]], n_ctx=args.n_ctx, n_parallel=args.slots, allow_same_node=False
    )
    url = cl.ctl.url + "/v1/chat/completions"
    turn = run_turn(
        url,
        cl.ctl.api_key,
        streams=8,
        requests=32,
        max_tokens=args.max_tokens // 2 or 8,
        model=MODEL_NAME,
        offset=500,
    )
    counts = Counter(r.deployment for r in turn.results)
    shares = {d: counts.get(d, 0) / max(1, len(turn.results)) for d in (dep["id"], second["id"])}
    worst = min(shares.values())
    print(f"[two replicas] 32 requests, 8 at a time: {' / '.join(f'{v:.0%}' for v in shares.values())} "
          f"[goal each >= {GOAL_SPREAD:.0%}]  {'PASS' if worst >= GOAL_SPREAD else 'FAIL'}"
          + (f"  errors: {len(turn.errors)}" if turn.errors else ""), flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
