"""Gateway benchmark: RACoN's streamed chat against llama-cpp-python called directly, in one run.

Run: ``python bench/gateway.py [--requests 20] [--max-tokens 64] [--threads N] [--quick]``.

Both sides use the same model (SmolLM2), prompts, max_tokens, sampling (temperature 0), n_ctx,
n_threads, n_batch and flash-attention setting; the direct side reads them from the deployed
plan. RACoN runs as in production: HTTP -> daphne -> Redis -> node agent -> primary process
(llama.cpp) -> Redis stream -> SSE. The direct side is one separate process (like the primary)
that calls ``Llama.create_chat_completion(stream=True)``. Requests alternate A/B/B/A so that drift
in the machine's load falls on both sides; every pair uses the same prompt, and both Llama
objects see the same sequence of prompts (llama-cpp-python reuses the cached prompt prefix).

Printed: RACoN tokens/s / direct tokens/s (goal >= 0.95), the added time to first token (RACoN
minus direct, same run; goal <= 15 ms at p50), and where RACoN's extra time goes, from the job's
recorded timestamps, the Redis stream's entry ids (the server's clock, 1 ms resolution) and the
client's own clock. Everything runs on loopback and is stopped at the end.

Threads: by default the node reports its real cores and the plan (so both sides) uses all of them.
On a small shared machine that oversubscribes the CPUs and llama.cpp's thread barriers measure the
neighbours more than RACoN; ``--threads N`` poses the node with N cores (a hardware profile built
from the real detection) so the plan, and with it both sides, use N threads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from httpx_sse import connect_sse

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TTFT_GOAL_MS = 15.0
TPS_GOAL = 0.95
SYSTEM = "You are a helpful assistant."
TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "a city built on the back of a turtle",
    "two rival bakers in a small village",
    "a map that redraws itself every night",
    "a violinist who can play the weather",
    "the last library on the moon",
    "a cat that runs a post office",
]


def prompt(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Story {i}: write a long, detailed story about {topic}."},
    ]


# --- the direct side: one process with one Llama, driven over stdin/stdout ------------------------


def direct_worker(cfg: dict[str, Any]) -> int:
    """Load the model as the primary does, warm it up the same way, then time each request."""
    from llama_cpp import Llama

    from agent.runtime.ggml import load_llama_cpp_backends

    load_llama_cpp_backends()  # a GPU build's (GGML_BACKEND_DL) backends are modules in its lib/
    llm = Llama(
        model_path=cfg["model_path"],
        n_gpu_layers=int(cfg.get("n_gpu_layers", 0)),
        n_ctx=int(cfg["n_ctx"]),
        n_threads=int(cfg["n_threads"]),
        n_threads_batch=int(cfg["n_threads"]),
        n_batch=int(cfg["n_batch"]),
        flash_attn=bool(cfg.get("flash_attn", False)),
        verbose=False,
    )
    # The primary's warm-up (agent/runtime/server.py ServerPrimary._warm_up).
    llm.create_chat_completion(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0.0
    )
    llm.reset()
    out = sys.stdout
    out.write(json.dumps({"op": "ready"}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        times: list[float] = []
        parts: list[str] = []
        t0 = time.perf_counter()
        for chunk in llm.create_chat_completion(
            messages=req["messages"],
            max_tokens=int(req["max_tokens"]),
            temperature=0.0,
            top_p=1.0,
            stop=[],
            presence_penalty=0.0,
            frequency_penalty=0.0,
            stream=True,
        ):
            text = chunk["choices"][0]["delta"].get("content")
            if text:
                times.append(time.perf_counter())
                parts.append(text)
        t_end = time.perf_counter()
        out.write(
            json.dumps(
                {
                    "ttft_ms": (times[0] - t0) * 1000 if times else None,
                    "chunks": len(times),
                    "decode_s": times[-1] - times[0] if len(times) > 1 else None,
                    "total_s": t_end - t0,
                    "text": "".join(parts),
                }
            )
            + "\n"
        )
        out.flush()
    return 0


class Direct:
    def __init__(self, cfg: dict[str, Any], log_path: Path) -> None:
        self.log = open(log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--direct-worker", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
        ready = self._read(timeout_hint="loading the model")
        if ready.get("op") != "ready":
            raise RuntimeError(f"direct worker did not start: {ready}")

    def _read(self, timeout_hint: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"direct worker exited ({self.proc.poll()}) while {timeout_hint}; see {self.log.name}"
            )
        return dict(json.loads(line))

    def run(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"messages": messages, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_hint="generating")

    def stop(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.log.close()


# --- the RACoN side ---------------------------------------------------------------------------------


@dataclass
class RaconResult:
    job_id: str
    t0: float  # wall clock at send
    headers_s: float  # seconds from send, client clock
    first_s: float | None
    last_s: float | None
    done_s: float  # [DONE] received
    closed_s: float  # response body ended
    chunks: int
    text: str
    usage: dict[str, Any] | None
    job: dict[str, Any] = field(default_factory=dict)
    stream_ms: dict[str, float] = field(default_factory=dict)  # Redis entry times (epoch ms)


def racon_request(
    client: Any, url: str, key: str, messages: list[dict[str, str]], max_tokens: int
) -> RaconResult:
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    parts: list[str] = []
    usage = None
    done_s = float("nan")
    t0_wall, p0 = time.time(), time.perf_counter()
    with connect_sse(
        client,
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as events:
        resp = events.response
        headers_s = time.perf_counter() - p0
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"RACoN answered {resp.status_code}: {resp.text[:300]}")
        job_id = resp.headers["x-racon-job-id"]
        for event in events.iter_sse():
            if event.data == "[DONE]":
                # Keep reading: the response ends when RACoN's bookkeeping is done (closed_s).
                done_s = time.perf_counter() - p0
                continue
            obj = json.loads(event.data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    times.append(time.perf_counter() - p0)
                    parts.append(text)
        closed_s = time.perf_counter() - p0
    return RaconResult(
        job_id=job_id,
        t0=t0_wall,
        headers_s=headers_s,
        first_s=times[0] if times else None,
        last_s=times[-1] if times else None,
        done_s=done_s,
        closed_s=closed_s,
        chunks=len(times),
        text="".join(parts),
        usage=usage,
    )


def stream_times(redis_client: Any, job_id: str) -> dict[str, float]:
    """Epoch ms at which the primary's writer added the first/last chunk and the final entry."""
    keys = list(
        redis_client.scan_iter(match=f"racon:n:*:job:{job_id}")
    )  # under its primary's prefix
    rows = redis_client.xrange(keys[0]) if keys else []
    out: dict[str, float] = {}
    for entry_id, fields in rows:
        ms = float(entry_id.split("-")[0])
        kind = fields.get("type")
        if kind == "chunk":
            out.setdefault("first_chunk", ms)
            out["last_chunk"] = ms
        elif kind in ("done", "error"):
            out["end"] = ms
    return out


def _epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# --- statistics and printing --------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    s = sorted(v for v in values if v is not None)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def med(values: list[float | None]) -> float:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else float("nan")


@dataclass
class Pair:
    i: int
    order: str  # "DR" or "RD"
    direct: dict[str, Any]
    racon: RaconResult


def breakdown(pairs: list[Pair]) -> list[tuple[str, list[float | None]]]:
    """Per-request segments (ms) that add up to RACoN's client-side time to first token."""
    rows: dict[str, list[float | None]] = {
        k: []
        for k in (
            "a",
            "b",
            "c",
            "d",
            "e",
            "f",
            "ttft",
            "direct",
            "rt_minus_direct",
            "tail_stream",
            "tail_done",
            "tail_closed",
            "finish_db",
        )
    }
    for p in pairs:
        r, j, s = p.racon, p.racon.job, p.racon.stream_ms
        t0 = r.t0 * 1000
        queued, dispatched = _epoch(j.get("queued_at")), _epoch(j.get("dispatched_at"))
        first_tok, finished = _epoch(j.get("first_token_at")), _epoch(j.get("finished_at"))
        queued = queued * 1000 if queued else None
        dispatched = dispatched * 1000 if dispatched else None
        first_tok = first_tok * 1000 if first_tok else None
        finished = finished * 1000 if finished else None
        c_first = t0 + r.first_s * 1000 if r.first_s is not None else None
        c_last = t0 + r.last_s * 1000 if r.last_s is not None else None
        c_done = t0 + r.done_s * 1000
        c_closed = t0 + r.closed_s * 1000
        rt = j.get("ttft_ms")
        s_first = s.get("first_chunk")

        def d(a: float | None, b: float | None) -> float | None:
            return b - a if a is not None and b is not None else None

        to_first = d(dispatched, s_first)
        rows["a"].append(d(t0, queued))
        rows["b"].append(d(queued, dispatched))
        rows["c"].append(to_first - rt if to_first is not None and rt is not None else None)
        rows["d"].append(rt)
        rows["e"].append(d(s_first, first_tok))
        rows["f"].append(d(first_tok, c_first))
        rows["ttft"].append(d(t0, c_first))
        rows["direct"].append(p.direct.get("ttft_ms"))
        rows["rt_minus_direct"].append(
            rt - p.direct["ttft_ms"]
            if rt is not None and p.direct.get("ttft_ms") is not None
            else None
        )
        rows["tail_stream"].append(d(s.get("last_chunk"), c_last))
        rows["tail_done"].append(d(s.get("end"), c_done))
        rows["tail_closed"].append(d(s.get("end"), c_closed))
        rows["finish_db"].append(d(s.get("end"), finished))
    labels = {
        "a": "client send -> job queued_at      (HTTP, daphne, auth x2, validation, model lookup)",
        "b": "queued_at -> dispatched_at        (job row + credit hold, route, queue/slot in Redis)",
        "c": "dispatched_at -> primary receives (JOB_DISPATCHED txn, run_job push, agent BLMOVE, stdin hop)",
        "d": "primary: received -> first chunk  (runtime ttft_ms: prompt eval + first token)",
        "e": "first chunk in Redis -> view      (XREAD wake-up; first_token_at)",
        "f": "first_token_at -> client 1st text (job RUNNING write, response start, 2 SSE events)",
    }
    return [(labels[k], rows[k]) for k in "abcdef"] + [
        ("= RACoN client TTFT", rows["ttft"]),
        ("  direct TTFT (same prompt, same run)", rows["direct"]),
        (
            "  runtime ttft_ms - direct TTFT  (work inside the primary beyond llama.cpp's)",
            rows["rt_minus_direct"],
        ),
        ("tail: last chunk in Redis -> client's last text", rows["tail_stream"]),
        ("tail: final entry in Redis -> job finished_at (completion write)", rows["finish_db"]),
        (
            "tail: final entry in Redis -> client [DONE]  (job COMPLETED write, settlement publish, metrics)",
            rows["tail_done"],
        ),
        ("tail: final entry in Redis -> response closed", rows["tail_closed"]),
    ]


def report(
    pairs: list[Pair], args: argparse.Namespace, plan: dict[str, Any], load_before: str
) -> bool:
    direct_tps, racon_tps, runtime_tps, ratio_tps, ratio_rt = [], [], [], [], []
    e2e_d, e2e_r, added, same = [], [], [], 0
    for p in pairs:
        d, r = p.direct, p.racon
        dt = (d["chunks"] - 1) / d["decode_s"] if d.get("decode_s") else None
        rtps = (
            (r.chunks - 1) / (r.last_s - r.first_s)
            if r.first_s is not None and r.last_s and r.last_s > r.first_s
            else None
        )
        rt = r.job.get("tokens_per_s")
        direct_tps.append(dt)
        racon_tps.append(rtps)
        runtime_tps.append(rt)
        if dt and rtps:
            ratio_tps.append(rtps / dt)
        if dt and rt:
            ratio_rt.append(rt / dt)
        e2e_d.append(d["chunks"] / d["total_s"] if d["total_s"] else None)
        e2e_r.append(r.chunks / r.closed_s if r.closed_s else None)
        if r.first_s is not None and d.get("ttft_ms") is not None:
            added.append(r.first_s * 1000 - d["ttft_ms"])
        same += int(d["text"] == r.text)
    e2e_ratio = [a / b for a, b in zip(e2e_r, e2e_d, strict=True) if a and b]
    n = len(pairs)
    tps_ratio = med(ratio_tps)
    add50, add90 = pct(added, 50), pct(added, 90)
    print(
        f"== RACoN vs llama-cpp-python direct: SmolLM2, {n} request pairs (A/B/B/A), max_tokens {args.max_tokens}, "
        f"temperature 0, n_ctx {plan['n_ctx']}, n_threads {plan['n_threads']}, n_batch {plan['n_batch']} =="
    )
    print(
        f"tokens/s RACoN / direct (decode, client side): median of paired ratios {tps_ratio:.3f} "
        f"(p10 {pct(ratio_tps, 10):.3f}, p90 {pct(ratio_tps, 90):.3f})  [goal >= {TPS_GOAL}]  "
        f"{'PASS' if tps_ratio >= TPS_GOAL else 'FAIL'}"
    )
    print(
        f"added TTFT, RACoN - direct (paired): p50 {add50:+.1f} ms  p90 {add90:+.1f} ms  "
        f"[goal p50 <= {TTFT_GOAL_MS:.0f} ms]  {'PASS' if add50 <= TTFT_GOAL_MS else 'FAIL'}"
    )
    outside = [
        p.racon.first_s * 1000 - p.racon.job["ttft_ms"]
        for p in pairs
        if p.racon.first_s is not None and p.racon.job.get("ttft_ms") is not None
    ]
    print(
        "  of which outside the primary (client TTFT - the primary's own ttft_ms, same request; "
        "free of prompt-eval noise): "
        f"p50 {pct(outside, 50):.1f} ms  p90 {pct(outside, 90):.1f} ms"
    )
    ttft_ratios = [
        r.racon.first_s * 1000 / r.direct["ttft_ms"]
        for r in pairs
        if r.racon.first_s and r.direct.get("ttft_ms")
    ]
    print(f"TTFT RACoN / direct: p50 {med(ttft_ratios):.2f}x")
    print(
        f"primary's own decode tokens/s (runtime) / direct: median {med(ratio_rt):.3f}   "
        f"(separates generation speed inside the primary from delivery)"
    )
    print(
        "end-to-end tokens/s RACoN / direct (send -> response closed, TTFT and bookkeeping "
        f"included): median {med(e2e_ratio):.3f}"
    )
    print(
        f"identical output text in {same}/{n} pairs; "
        f"chunks per request: RACoN {med([p.racon.chunks for p in pairs]):.0f}, "
        f"direct {med([p.direct['chunks'] for p in pairs]):.0f}"
    )
    print(
        f"  (medians: direct decode {med(direct_tps):.1f} tok/s, RACoN decode {med(racon_tps):.1f} tok/s, "
        f"primary runtime {med(runtime_tps):.1f} tok/s; direct TTFT {med([p.direct['ttft_ms'] for p in pairs]):.1f} ms)"
    )
    print("== where RACoN's time goes (per request, ms: p50 / p90) ==")
    for label, values in breakdown(pairs):
        v = [x for x in values if x is not None]
        if v:
            print(f"  {label:<100} {pct(v, 50):8.2f} / {pct(v, 90):8.2f}")
        else:
            print(f"  {label:<100}      n/a")
    print(f"({load_before}; after: {_load()})")
    return True


def _load() -> str:
    from bench.common import load_average

    return load_average()


# --- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--requests", type=int, default=20, help="measured request pairs (RACoN + direct each)"
    )
    ap.add_argument(
        "--warmup", type=int, default=3, help="warm-up requests on each side, not measured"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pose the node as having N cores, so the plan (and both sides) use N threads; default: as detected",
    )
    ap.add_argument(
        "--gap", type=float, default=0.3, help="seconds between requests (lets settlement finish)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=600,
        help="stop starting new pairs after this many seconds of measuring (at least 3 pairs)",
    )
    ap.add_argument(
        "--operator-key",
        action="store_true",
        help="use AI_API_KEY instead of an account's key (no credit hold)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for smoke tests: 2 pairs, 1 warm-up, 16 tokens",
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the temporary directory with the logs"
    )
    ap.add_argument("--direct-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.direct_worker:
        return direct_worker(json.loads(args.direct_worker))
    if args.quick:
        args.requests, args.warmup, args.max_tokens, args.gap = (
            min(args.requests, 2),
            min(args.warmup, 1),
            min(args.max_tokens, 16),
            0.1,
        )
    if args.requests < 1 or args.max_tokens < 2:
        ap.error("--requests must be >= 1 and --max-tokens >= 2")

    import httpx

    from bench.common import load_average, local_cluster

    load_before = "before: " + load_average()
    print(
        f"gateway bench: starting a local controller, one agent and SmolLM2 ({load_average()})",
        flush=True,
    )
    t_start = time.monotonic()
    with local_cluster(
        1, keep=args.keep, log=lambda s: print(s, flush=True), cores=args.threads
    ) as cl:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        dep = cl.deploy([cl.node_names[0]], n_ctx=args.n_ctx)
        plan = dep["plan"]
        key = os.environ["AI_API_KEY"]
        key_kind = "operator key (AI_API_KEY)"
        if not args.operator_key:
            from apps.api.auth import api_key_create
            from apps.credits.ledger import account_create

            acct = account_create(name="gateway-bench")
            _, key = api_key_create(name="gateway-bench", account_id=acct.pk, scopes=["inference"])
            key_kind = "an account's API key (credit hold + settlement on every request)"
        cfg = {
            "model_path": str(cl.model_path),
            "n_ctx": int(plan["n_ctx"]),
            "n_threads": int(plan["n_threads"]),
            "n_batch": int(plan["n_batch"]),
            "flash_attn": bool(plan.get("flash_attn", False)),
            "n_gpu_layers": int(plan.get("n_gpu_layers") or 0),
        }
        posed = (
            f" (node posed with {args.threads} core(s))"
            if args.threads
            else " (node's detected cores)"
        )
        print(
            f"  both sides: {cfg['n_threads']} threads{posed}, n_ctx {cfg['n_ctx']}, "
            f"n_batch {cfg['n_batch']} (from the plan); RACoN with {key_kind}",
            flush=True,
        )
        direct = Direct(cfg, cl.workdir / "direct-worker.log")
        rds = cl.env.redis()
        pairs: list[Pair] = []
        try:
            with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
                for w in range(args.warmup):
                    racon_request(client, cl.ctl.url, key, prompt(1000 + w), args.max_tokens)
                    direct.run(prompt(1000 + w), args.max_tokens)
                print(
                    f"  warm-up done ({args.warmup} request(s) each side); measuring {args.requests} pairs",
                    flush=True,
                )
                t_measure = time.monotonic()
                for i in range(args.requests):
                    if i >= 3 and time.monotonic() - t_measure > args.budget_s:
                        print(
                            f"  time budget of {args.budget_s:.0f} s spent: "
                            f"stopping after {i} of {args.requests} pairs",
                            flush=True,
                        )
                        break
                    messages = prompt(i)
                    order = "DR" if i % 4 in (0, 3) else "RD"
                    d_res: dict[str, Any] = {}
                    r_res: RaconResult | None = None
                    for side in order:
                        time.sleep(args.gap)
                        if side == "D":
                            d_res = direct.run(messages, args.max_tokens)
                        else:
                            r_res = racon_request(
                                client, cl.ctl.url, key, messages, args.max_tokens
                            )
                    assert r_res is not None
                    r_res.stream_ms = stream_times(rds, r_res.job_id)
                    r_res.job = cl.job(r_res.job_id)
                    if r_res.job.get("state") != "COMPLETED":
                        raise RuntimeError(
                            f"job {r_res.job_id} ended {r_res.job.get('state')}: {r_res.job.get('error')}"
                        )
                    pairs.append(Pair(i, order, d_res, r_res))
        finally:
            direct.stop()
            rds.close()
        report(pairs, args, plan, load_before)
        one_min = os.getloadavg()[0]
        if (
            int(plan["n_threads"]) >= (os.cpu_count() or 1)
            and one_min >= (os.cpu_count() or 1) - 0.5
        ):
            print(
                f"note: n_threads {plan['n_threads']} uses every CPU of a machine whose load "
                f"average is {one_min:.1f}; llama.cpp's thread barriers then stall on the "
                "neighbours and both sides measure mostly noise (try --threads 1)"
            )
    print(f"(whole run {time.monotonic() - t_start:.0f} s, every process it started is stopped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
