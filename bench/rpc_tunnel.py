"""RPC tunnel benchmark: a split plan's decode speed through the authenticated tunnel vs direct.

Run: ``python bench/rpc_tunnel.py [--pairs 8] [--max-tokens 64]``.

Two plans of SmolLM2 on loopback, each split over two real ggml-rpc workers (1 thread each) with
a real llama-server primary: A goes through the tunnel (the workers bind 127.0.0.1, each behind
its TunnelServer; the primary dials through TunnelClients), B connects llama-server straight to
ggml-rpc (how it was before the tunnel). Both are loaded at once and asked the same prompts at
temperature 0 in A/B/B/A order, one request at a time, so drift in the machine's load falls on
both. Printed: the median of the paired tokens/s ratios (goal >= 0.9, CLARIFICATIONS), with p10
and p90, and whether the texts matched. Bounded: pairs x 2 requests, each with a 120 s limit.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL = 0.9
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about a new job.",
]


def main() -> int:
    import redis

    from agent.protocol import job_stream_key
    from agent.runtime.rpc_worker import RpcWorker
    from agent.runtime.server import ServerPrimary
    from bench.common import load_average
    from racon.embedded import start_redis
    from tests.e2e.harness import free_port
    from tests.smollm2 import smollm2_path

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="racon-tunnel-bench-"))
    model = smollm2_path()
    rs = start_redis(data_dir=tmp / "redis")
    r = redis.Redis.from_url(rs.url, decode_responses=True)
    events: list[Any] = []
    workers: list[RpcWorker] = []
    primaries: dict[str, ServerPrimary] = {}
    finished: dict[str, dict[str, Any]] = {}
    print(
        f"== RPC tunnel: split plan (2 ggml-rpc workers, loopback) through the tunnel vs direct; {load_average()} ==",
        flush=True,
    )
    try:
        for arm, tunnel in (("tunnel", True), ("direct", False)):
            ws = [
                RpcWorker(host="127.0.0.1", port=free_port(), cache_dir=tmp / f"{arm}-cache{i}", n_threads=1,
                          log_path=tmp / f"{arm}-rpc{i}.log", on_event=lambda *a: events.append(a), tunnel=tunnel)
                for i in range(2)
            ]  # fmt: skip
            for w in ws:
                w.start()
            workers += ws
            dep = f"dep-{arm}"
            plan: dict[str, Any] = {
                "deployment_id": dep, "model_name": "smollm2", "sha256": "0" * 64,
                "rpc_endpoints": [w.endpoint for w in ws], "tensor_split": [1.0, 1.0],
                "n_gpu_layers": -1, "n_ctx": 512, "n_parallel": 1, "n_threads": 1,
            }  # fmt: skip
            if tunnel:
                plan["rpc_tunnel_key"] = key = secrets.token_hex(32)
                for w in ws:
                    w.authorize(dep, key, "127.0.0.1")
            primaries[arm] = ServerPrimary(
                node_id="node-rt",
                plan=plan, model_path=model, redis_client=r, redis_url=rs.url,  # type: ignore[arg-type]
                log_path=tmp / f"{arm}-primary.log",
                on_event=lambda *a: events.append(a),
                on_job_finished=lambda f: finished.__setitem__(f["job_id"], f), on_exit=lambda d: None,
            )  # fmt: skip
            primaries[arm].load()

        def run(arm: str, i: int) -> tuple[float, str]:
            job_id = f"{arm}-{i}-{secrets.token_hex(4)}"
            primaries[arm].submit({
                "job_id": job_id, "deployment_id": f"dep-{arm}", "kind": "chat",
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": args.max_tokens,
                "temperature": 0.0, "top_p": 1.0, "stop": [], "presence_penalty": 0.0, "frequency_penalty": 0.0,
            })  # fmt: skip
            deadline = time.monotonic() + 120
            while job_id not in finished and time.monotonic() < deadline:
                time.sleep(0.005)
            f = finished.get(job_id)
            if f is None or f["status"] != "completed" or not f.get("tokens_per_s"):
                raise RuntimeError(f"{arm} request {i} did not complete: {f}")
            text = "".join(
                e["text"]
                for _, e in r.xrange(job_stream_key(job_id, "node-rt"))
                if e["type"] == "chunk"
            )
            return float(f["tokens_per_s"]), text

        run("tunnel", 0), run("direct", 0)  # warm both
        ratios, same = [], 0
        for i in range(args.pairs):
            order = ("tunnel", "direct", "direct", "tunnel")
            got: dict[str, list[tuple[float, str]]] = {"tunnel": [], "direct": []}
            for k, arm in enumerate(order):
                got[arm].append(run(arm, 2 * i + (k // 2)))
            for (ta, xa), (tb, xb) in zip(got["tunnel"], got["direct"], strict=True):
                ratios.append(ta / tb)
                same += int(xa == xb)
        q = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else [ratios[0]] * 9
        med = statistics.median(ratios)
        print(f"decode tokens/s, tunnel / direct: median of {len(ratios)} paired ratios {med:.3f} "
              f"(p10 {q[0]:.3f}, p90 {q[-1]:.3f})  [goal >= {GOAL}]  {'PASS' if med >= GOAL else 'FAIL'}")  # fmt: skip
        print(f"identical text in {same}/{len(ratios)} pairs")
        refused = [e for e in events if e[0] == "RPC_TUNNEL_REFUSED"]
        print(f"tunnel refusals during the run: {len(refused)}")
    finally:
        for prim in primaries.values():
            prim.stop()
        for w in workers:
            w.stop()
        rs.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
