"""RPC tunnel benchmark: a split plan's decode speed through the tunnel (mutual TLS with a
per-deployment certificate from a controller CA, agent/tunnel.py) vs direct.

Run: ``python bench/rpc_tunnel.py [--pairs 8] [--max-tokens 64]``; across two network-namespace
hosts (tests/cluster/harness.py, needs root): ``.venv/bin/python bench/rpc_tunnel.py --netns``.

Two plans of SmolLM2 on loopback, each split over two real ggml-rpc workers (1 thread each) with
a real llama-server primary: A goes through the tunnel (the workers bind 127.0.0.1, each behind
its TunnelServer; the primary dials through TunnelClients), B connects llama-server straight to
ggml-rpc (how it was before the tunnel). Both are loaded at once and asked the same prompts at
temperature 0 in A/B/B/A order, one request at a time, so drift in the machine's load falls on
both. Printed: the median of the paired tokens/s ratios (goal >= 0.9, CLARIFICATIONS), with p10
and p90, and whether the texts matched. Bounded: pairs x 2 requests, each with a 120 s limit.

``--netns``: the same A/B across hosts. Two namespace hosts on a LAN-like link (``--delay-ms``
each way per host, 0.5 by default: a 1 ms round trip; ``--rate-mbit`` 1000 by default, tc tbf):
the primary host runs both llama-server primaries (and a Redis on its loopback), the worker host
one ggml-rpc worker per arm. Each plan keeps half of SmolLM2's layers on the primary's CPU and
puts the other half on the remote worker: a two-host split. A's worker binds ggml-rpc to its
127.0.0.1 behind the tunnel on the host's address (the agent's way); B's binds ggml-rpc itself
to the host's address (bench only; an agent never does, see agent/runtime/rpc_worker.py).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from agent.protocol import job_stream_key  # noqa: E402
from agent.runtime.rpc_worker import RpcWorker  # noqa: E402
from agent.runtime.server import ServerPrimary  # noqa: E402
from agent.tunnel import TunnelTls  # noqa: E402
from bench.common import load_average  # noqa: E402
from racon.embedded import start_redis  # noqa: E402
from racon.tls import ca_load_or_create, issue_leaf  # noqa: E402
from tests.cluster.harness import LinkSpec, namespace_hosts, skip_reason, stop_process  # noqa: E402
from tests.e2e.harness import free_port  # noqa: E402
from tests.smollm2 import smollm2_path  # noqa: E402

GOAL = 0.9
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about a new job.",
]


ARMS = ("tunnel", "direct")
KEY_ENV = "RACON_BENCH_TUNNEL_KEY"
NODE_ID = "node-rt"
TLS_FILE = "tunnel-tls.json"


def deployment_tls(var_dir: Path, deployment_id: str) -> TunnelTls:
    """As the controller issues it (apps/jobs/placement.py): a leaf from its CA per deployment."""
    ca, _ = ca_load_or_create(var_dir=var_dir)
    leaf = issue_leaf(ca, common_name=f"racon-tunnel {deployment_id}", server=True, client=True)
    return TunnelTls(cert=leaf.cert_pem.decode(), key=leaf.key_pem.decode(), ca=ca.pem().decode())


def measure(
    primaries: dict[str, ServerPrimary],
    r: redis.Redis,
    finished: dict[str, dict[str, Any]],
    events: list[Any],
    *,
    pairs: int,
    max_tokens: int,
) -> list[str]:
    """A/B/B/A requests at temperature 0 after one warm-up each; the report's lines."""

    def run(arm: str, i: int) -> tuple[float, str]:
        job_id = f"{arm}-{i}-{secrets.token_hex(4)}"
        primaries[arm].submit({
            "job_id": job_id, "deployment_id": f"dep-{arm}", "kind": "chat",
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
            "temperature": 0.0, "top_p": 1.0, "stop": [], "presence_penalty": 0.0, "frequency_penalty": 0.0,
        })  # fmt: skip
        deadline = time.monotonic() + 120
        while job_id not in finished and time.monotonic() < deadline:
            time.sleep(0.005)
        f = finished.get(job_id)
        if f is None or f["status"] != "completed" or not f.get("tokens_per_s"):
            raise RuntimeError(f"{arm} request {i} did not complete: {f}")
        text = "".join(
            e["text"] for _, e in r.xrange(job_stream_key(job_id, NODE_ID)) if e["type"] == "chunk"
        )
        return float(f["tokens_per_s"]), text

    run("tunnel", 0), run("direct", 0)  # warm both
    ratios, same = [], 0
    rates: dict[str, list[float]] = {"tunnel": [], "direct": []}
    for i in range(pairs):
        order = ("tunnel", "direct", "direct", "tunnel")
        got: dict[str, list[tuple[float, str]]] = {"tunnel": [], "direct": []}
        for k, arm in enumerate(order):
            got[arm].append(run(arm, 2 * i + (k // 2)))
        for (ta, xa), (tb, xb) in zip(got["tunnel"], got["direct"], strict=True):
            ratios.append(ta / tb)
            rates["tunnel"].append(ta)
            rates["direct"].append(tb)
            same += int(xa == xb)
    q = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else [ratios[0]] * 9
    med = statistics.median(ratios)
    refused = [e for e in events if e[0] == "RPC_TUNNEL_REFUSED"]
    return [
        f"tunnel/direct tokens/s (median of {len(ratios)} interleaved pairs): {med:.2f}x "
        f"[goal >= {GOAL:.2f}x]  {'PASS' if med >= GOAL else 'FAIL'}",
        f"paired ratios p10 {q[0]:.3f}, p90 {q[-1]:.3f}; decode tokens/s medians: tunnel "
        f"{statistics.median(rates['tunnel']):.1f}, direct {statistics.median(rates['direct']):.1f}",
        f"identical text in {same}/{len(ratios)} pairs",
        f"tunnel refusals during the run: {len(refused)}",
    ]


def _plan(arm: str, endpoints: list[str], *, n_gpu_layers: int) -> dict[str, Any]:
    return {
        "deployment_id": f"dep-{arm}", "model_name": "smollm2", "sha256": "0" * 64,
        "rpc_endpoints": endpoints, "tensor_split": [1.0] * len(endpoints),
        "n_gpu_layers": n_gpu_layers, "n_ctx": 512, "n_parallel": 1, "n_threads": 1,
    }  # fmt: skip


def _primary(
    arm: str,
    plan: dict[str, Any],
    tmp: Path,
    rs_url: str,
    r: redis.Redis,
    events: list[Any],
    finished: dict[str, dict[str, Any]],
) -> ServerPrimary:
    prim = ServerPrimary(
        node_id=NODE_ID,
        plan=plan, model_path=smollm2_path(), redis_client=r, redis_url=rs_url,  # type: ignore[arg-type]
        log_path=tmp / f"{arm}-primary.log",
        on_event=lambda *a: events.append(a),
        on_job_finished=lambda f: finished.__setitem__(f["job_id"], dict(f)), on_exit=lambda d: None,
    )  # fmt: skip
    prim.load()
    return prim


def loopback(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="racon-tunnel-bench-"))
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
        for arm in ARMS:
            tunnel = arm == "tunnel"
            ws = [
                RpcWorker(host="127.0.0.1", port=free_port(), cache_dir=tmp / f"{arm}-cache{i}", n_threads=1,
                          log_path=tmp / f"{arm}-rpc{i}.log", on_event=lambda *a: events.append(a), tunnel=tunnel)
                for i in range(2)
            ]  # fmt: skip
            for w in ws:
                w.start()
            workers += ws
            plan = _plan(arm, [w.endpoint for w in ws], n_gpu_layers=-1)
            if tunnel:
                plan["rpc_tunnel_key"] = key = secrets.token_hex(32)
                tls = deployment_tls(tmp / "var", f"dep-{arm}")
                plan["rpc_tunnel_tls"] = tls.to_wire()
                for w in ws:
                    w.authorize(f"dep-{arm}", key, "127.0.0.1", tls)
            primaries[arm] = _primary(arm, plan, tmp, rs.url, r, events, finished)
        for line in measure(
            primaries, r, finished, events, pairs=args.pairs, max_tokens=args.max_tokens
        ):
            print(line, flush=True)
    finally:
        for prim in primaries.values():
            prim.stop()
        for w in workers:
            w.stop()
        rs.stop()
    return 0


def _free_port_on(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _stop_on_sigterm() -> None:
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)


def worker_role(args: argparse.Namespace) -> int:
    """In the worker's namespace: one ggml-rpc worker per arm; their endpoints go to workers.json."""
    _stop_on_sigterm()
    wd = Path(args.workdir)
    events: list[Any] = []
    ws: dict[str, RpcWorker] = {}
    try:
        for arm in ARMS:
            ws[arm] = RpcWorker(
                host=args.address, port=_free_port_on(args.address), cache_dir=wd / f"{arm}-cache",
                n_threads=1, log_path=wd / f"{arm}-rpc.log", on_event=lambda *a: events.append(a),
                tunnel=arm == "tunnel",
            )  # fmt: skip
            ws[arm].start()
        tls = TunnelTls(**json.loads((wd / TLS_FILE).read_text()))
        ws["tunnel"].authorize("dep-tunnel", os.environ[KEY_ENV], args.peer, tls)
        tmp = wd / "workers.tmp"
        tmp.write_text(json.dumps({arm: w.endpoint for arm, w in ws.items()}))
        tmp.replace(wd / "workers.json")
        print(f"workers up: {json.dumps({arm: w.endpoint for arm, w in ws.items()})}", flush=True)
        while True:
            time.sleep(1)
            refused = [e for e in events if e[0] == "RPC_TUNNEL_REFUSED"]
            if refused:
                print(f"tunnel refused: {refused}", flush=True)
                events.clear()
    finally:
        for w in ws.values():
            w.stop()


def primary_role(args: argparse.Namespace) -> int:
    """In the primary's namespace: both arms' primaries, measured; the report goes to report.txt."""
    _stop_on_sigterm()
    wd = Path(args.workdir)
    eps = json.loads((wd / "workers.json").read_text())
    rs = start_redis(data_dir=wd / "redis")
    r = redis.Redis.from_url(rs.url, decode_responses=True)
    events: list[Any] = []
    finished: dict[str, dict[str, Any]] = {}
    primaries: dict[str, ServerPrimary] = {}
    try:
        for arm in ARMS:
            plan = _plan(arm, [eps[arm]], n_gpu_layers=args.remote_layers)
            if arm == "tunnel":
                plan["rpc_tunnel_key"] = os.environ[KEY_ENV]
                plan["rpc_tunnel_tls"] = json.loads((wd / TLS_FILE).read_text())
            t0 = time.monotonic()
            primaries[arm] = _primary(arm, plan, wd, rs.url, r, events, finished)
            where = ", ".join(
                f"{a['device']} {a['n_layers']} layers {a.get('model_buffer_mib', 0):.1f} MiB"
                for a in (primaries[arm].loaded or {}).get("assignment", [])
            )
            print(
                f"{arm} primary loaded in {time.monotonic() - t0:.1f} s; model buffers: {where}",
                flush=True,
            )
        lines = measure(
            primaries, r, finished, events, pairs=args.pairs, max_tokens=args.max_tokens
        )
        (wd / "report.txt").write_text("\n".join(lines) + "\n")
    finally:
        for prim in primaries.values():
            prim.stop()
        rs.stop()
    return 0


def across_hosts(args: argparse.Namespace) -> int:
    """Two namespace hosts: the primaries on one, the ggml-rpc workers on the other."""
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    wd = Path(tempfile.mkdtemp(prefix="racon-tunnel-netns-"))
    os.chmod(wd, 0o755)
    tls = deployment_tls(wd / "var", "dep-tunnel")
    fd = os.open(wd / TLS_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tls.to_wire(), f)
    link = LinkSpec(delay_ms=args.delay_ms, rate_mbit=args.rate_mbit)
    env = {
        **os.environ,
        KEY_ENV: secrets.token_hex(32),
        "GGML_NO_BACKTRACE": "1",
        "RACON_TEST_MODEL": str(smollm2_path()),  # found (or fetched) once, here
    }
    me = [sys.executable, str(Path(__file__).resolve()), "--workdir", str(wd)]
    print(
        f"== RPC tunnel across namespace hosts: two-host split (primary + 1 remote ggml-rpc worker "
        f"holding {args.remote_layers} of 30 layers), link {args.delay_ms:g} ms each way per host, "
        f"{args.rate_mbit:g} Mbit/s; {load_average()} ==",
        flush=True,
    )
    try:
        with namespace_hosts(wd / "hosts", {"primary": link, "worker": link}) as cl:
            worker = cl.ns_popen(
                "worker",
                [*me, "--role", "worker", "--address", cl.hosts["worker"].address,
                 "--peer", cl.hosts["primary"].address],
                wd / "worker.log", env=env,
            )  # fmt: skip
            procs = [worker]
            try:
                deadline = time.monotonic() + 120
                while not (wd / "workers.json").exists():
                    if worker.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"workers did not start:\n{(wd / 'worker.log').read_text()}"
                        )
                    time.sleep(0.2)
                primary = cl.ns_popen(
                    "primary",
                    [*me, "--role", "primary", "--pairs", str(args.pairs),
                     "--max-tokens", str(args.max_tokens), "--remote-layers", str(args.remote_layers)],
                    wd / "primary.log", env=env,
                )  # fmt: skip
                procs.append(primary)
                limit = 600 + args.pairs * 4 * 120
                try:
                    rc = primary.wait(timeout=limit)
                except subprocess.TimeoutExpired:
                    rc = -1
                report = wd / "report.txt"
                if rc != 0 or not report.exists():
                    print(
                        f"primary side failed (rc {rc}):\n{(wd / 'primary.log').read_text()[-4000:]}"
                    )
                    print(f"worker side:\n{(wd / 'worker.log').read_text()[-2000:]}")
                    return 1
                for line in (wd / "primary.log").read_text().splitlines():
                    if " primary loaded in " in line:
                        print(line)
                print(report.read_text(), end="", flush=True)
            finally:
                for proc in procs:
                    stop_process(proc)
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pairs", type=int, default=8, help="A/B/B/A rounds (2 paired ratios each)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--netns", action="store_true", help="across two namespace hosts (root)")
    p.add_argument("--delay-ms", type=float, default=0.5, help="--netns: each way, per host")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="--netns: 0 = unshaped")
    p.add_argument(
        "--remote-layers", type=int, default=15, help="--netns: layers on the remote worker"
    )
    p.add_argument("--role", choices=("primary", "worker"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if args.max_tokens < 16:
        p.error("--max-tokens must be at least 16")
    if not 1 <= args.remote_layers <= 29:
        p.error("--remote-layers must be between 1 and 29 (SmolLM2 has 30 layers)")
    if args.role == "worker":
        return worker_role(args)
    if args.role == "primary":
        return primary_role(args)
    if args.netns:
        return across_hosts(args)
    return loopback(args)


if __name__ == "__main__":
    sys.exit(main())
