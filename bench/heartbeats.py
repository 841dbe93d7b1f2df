"""Heartbeat throughput of the real controller under daphne, through the real endpoint.

Simulates N enrolled nodes (default 5,000) and drives their heartbeats for a bounded time:
  phase 1, paced at the target rate (N nodes / interval, default 1,000/s): latency p50/p99, errors;
  phase 2, closed loop with C connections: the most it sustains.
Prints ratios against the issue's targets (≥ 1,000/s, p99 < 100 ms, zero errors) and database
writes per heartbeat (rows written in nodes_node and nodes_event during the run, plus
pg_stat_database tuple writes on PostgreSQL).

    python bench/heartbeats.py [--nodes 5000] [--interval 5] [--seconds 10] [--connections 64]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.protocol import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def setup_env(tmp: Path) -> tuple[dict[str, str], object | None]:
    from racon.embedded import start_redis

    env = dict(os.environ)
    env.setdefault("DATABASE_URL", f"sqlite:///{tmp / 'bench.sqlite3'}")
    redis = None
    if not env.get("REDIS_URL"):
        redis = start_redis(data_dir=tmp / "redis")
        env["REDIS_URL"] = redis.url
    else:
        env["REDIS_URL"] = env["REDIS_URL"].rsplit("/", 1)[0] + "/12"
    env.update(
        {
            "RACON_VAR_DIR": str(tmp),
            "DJANGO_SETTINGS_MODULE": "racon.settings",
            "NODE_ENROLLMENT_SECRET": "bench",
            "SECRET_KEY": "bench-" + "x" * 50,
            "LOG_LEVEL": "WARNING",
            "HEARTBEAT_INTERVAL": "5",
        }
    )
    os.environ.update(env)
    return env, redis


def seed_nodes(n: int) -> list[tuple[str, str]]:
    """Create n READY nodes with known credentials, mirrored into Redis as enrollment does."""
    import django

    django.setup()
    from django.core.management import call_command
    from django.utils import timezone

    call_command("migrate", verbosity=0)
    from apps.credits.ledger import account_create
    from apps.nodes.models import Node
    from apps.nodes.services import _cache_node
    from racon.redis import get_redis

    get_redis().flushdb()
    acct = account_create(name=f"bench-{time.time_ns()}")
    now = timezone.now()
    creds = [(f"bench-cred-{i}-{time.time_ns()}") for i in range(n)]
    nodes = [
        Node(
            name=f"bench-{i}",
            machine_id=f"bench-machine-{i}-{time.time_ns()}",
            account=acct,
            state="READY",
            state_changed_at=now,
            credential_hash=hashlib.sha256(c.encode()).hexdigest(),
            address="10.0.0.1",
        )
        for i, c in enumerate(creds)
    ]
    Node.objects.bulk_create(nodes, batch_size=1000)
    for node in nodes:
        _cache_node(node)
    return [(str(node.id), c) for node, c in zip(nodes, creds, strict=True)]


def db_write_counter() -> int:
    """Rows written so far that a heartbeat could cause (node state changes and events)."""
    from django.db import connection

    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute(
                "SELECT tup_inserted + tup_updated + tup_deleted FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
            return int(cur.fetchone()[0])
        cur.execute(
            "SELECT (SELECT COUNT(*) FROM nodes_event) + (SELECT COUNT(*) FROM nodes_node"
            " WHERE state_changed_at > datetime('now', '-1 hour'))"
        )
        return int(cur.fetchone()[0])


class Conn:
    """A bare HTTP/1.1 keep-alive connection: the load generator must cost far less than the server."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, auth: str, body: bytes) -> int:
        assert self.reader and self.writer
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: {auth}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            if k.lower() == "content-length":
                length = int(v.strip())
        if length:
            await self.reader.readexactly(length)
        return status


BODY = json.dumps(
    {
        "protocol_version": PROTOCOL_VERSION,
        "state": "READY",
        "telemetry": {
            "cpu_percent": 12.5,
            "mem_available": 8 << 30,
            "gpu_free": [],
            "rpc_worker": {"running": True},
            "jobs": [],
        },
    }
).encode()


async def paced(
    port: int, nodes: list[tuple[str, str]], rate: float, seconds: float, connections: int
) -> tuple[list[float], int, int]:
    """Send `rate` heartbeats/s for `seconds` (open loop, spread over connections)."""
    conns = [Conn("127.0.0.1", port) for _ in range(connections)]
    await asyncio.gather(*(c.open() for c in conns))
    lat: list[float] = []
    errors = 0
    sent = 0
    total = int(rate * seconds)
    start = time.perf_counter()
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def worker(c: Conn) -> None:
        nonlocal errors
        while True:
            i = await queue.get()
            if i < 0:
                return
            node_id, cred = nodes[i % len(nodes)]
            t0 = time.perf_counter()
            try:
                status = await c.post("/api/agent/heartbeat", f"Node {node_id}:{cred}", BODY)
                if status != 200:
                    errors += 1
            except Exception:
                errors += 1
            lat.append(time.perf_counter() - t0)

    workers = [asyncio.create_task(worker(c)) for c in conns]
    for i in range(total):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait(i)
        sent += 1
    for _ in workers:
        queue.put_nowait(-1)
    await asyncio.wait_for(asyncio.gather(*workers), timeout=seconds + 30)
    elapsed = time.perf_counter() - start
    for c in conns:
        c.writer.close()  # type: ignore[union-attr]
    return lat, errors, int(len(lat) / elapsed)


async def closed_loop(
    port: int, nodes: list[tuple[str, str]], seconds: float, connections: int
) -> tuple[int, int, list[float]]:
    conns = [Conn("127.0.0.1", port) for _ in range(connections)]
    await asyncio.gather(*(c.open() for c in conns))
    stop = time.perf_counter() + seconds
    done = 0
    errors = 0
    lat: list[float] = []

    async def worker(k: int, c: Conn) -> None:
        nonlocal done, errors
        i = k
        while time.perf_counter() < stop:
            node_id, cred = nodes[i % len(nodes)]
            i += connections
            t0 = time.perf_counter()
            try:
                if await c.post("/api/agent/heartbeat", f"Node {node_id}:{cred}", BODY) != 200:
                    errors += 1
            except Exception:
                errors += 1
            lat.append(time.perf_counter() - t0)
            done += 1

    t = time.perf_counter()
    await asyncio.gather(*(worker(k, c) for k, c in enumerate(conns)))
    rate = int(done / (time.perf_counter() - t))
    for c in conns:
        c.writer.close()  # type: ignore[union-attr]
    return rate, errors, lat


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument(
        "--processes",
        type=int,
        default=2,
        help="daphne processes sharing the listening socket (make run's default on 2+ cores)",
    )
    ap.add_argument(
        "--compare-processes",
        type=int,
        default=1,
        help="also measure with this many processes, side by side (0: skip)",
    )
    ap.add_argument("--quick", action="store_true", help="a few seconds, for the smoke test")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.seconds = min(args.nodes, 500), 2.0
    if args.nodes < 1 or args.seconds <= 0 or args.connections < 1 or args.interval <= 0:
        ap.error("--nodes, --seconds, --connections and --interval must be positive")
    target = args.nodes / args.interval
    with tempfile.TemporaryDirectory(prefix="racon-hb-") as tmpdir:
        tmp = Path(tmpdir)
        env, redis = setup_env(tmp)
        try:
            nodes = seed_nodes(args.nodes)
            load = os.getloadavg()[0]
            print(
                f"== heartbeats: {args.nodes} nodes at a {args.interval:g} s interval "
                f"(target {target:.0f}/s), {args.seconds:g} s per phase, "
                f"load avg {load:.1f} on {os.cpu_count()} CPUs =="
            )
            counts = [args.processes] + (
                [args.compare_processes]
                if args.compare_processes and args.compare_processes != args.processes
                else []
            )
            results = {n: run_phase(env, nodes, args, target, n) for n in counts}
            if len(results) == 2:
                a, b = counts
                print(
                    f"{b} vs {a} daphne process(es): closed-loop throughput {results[b] / max(results[a], 1):.2f}x"
                )
            return 0 if all(v >= 0 for v in results.values()) else 1
        finally:
            if redis is not None:
                redis.stop()  # type: ignore[attr-defined]


def run_phase(
    env: dict[str, str],
    nodes: list[tuple[str, str]],
    args: argparse.Namespace,
    target: float,
    processes: int,
) -> int:
    """Paced then closed-loop load against `processes` daphne processes; returns the closed-loop rate."""
    import httpx

    from racon.serve import bind_listener, start_daphnes

    sock = bind_listener("127.0.0.1", 0)
    port = sock.getsockname()[1]
    daphnes = start_daphnes(
        sock, processes, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        # Warm up every process (imports, caches, connections).
        asyncio.run(closed_loop(port, nodes[: min(len(nodes), 500)], 1.5, 16 * processes))
        writes_before = db_write_counter()
        lat, errors, achieved = asyncio.run(
            paced(port, nodes, target, args.seconds, args.connections)
        )
        closed_rate, closed_errors, closed_lat = asyncio.run(
            closed_loop(port, nodes, min(args.seconds, 5.0), args.connections)
        )
        writes = db_write_counter() - writes_before
        total = len(lat) + len(closed_lat)
        label = f"[{processes} daphne process{'es' if processes > 1 else ''}]"
        print(
            f"{label} paced at the target: achieved {achieved}/s = {achieved / target:.2f}x the "
            f"target; p50 {pct(lat, 0.5):.1f} ms, p99 {pct(lat, 0.99):.1f} ms = "
            f"{pct(lat, 0.99) / 100:.2f}x the 100 ms limit; errors {errors}"
        )
        print(
            f"{label} closed loop ({args.connections} connections): sustained {closed_rate}/s = "
            f"{closed_rate / 1000:.2f}x the 1,000/s target; p50 {pct(closed_lat, 0.5):.1f} ms, "
            f"p99 {pct(closed_lat, 0.99):.1f} ms; errors {closed_errors}"
        )
        print(
            f"{label} database writes per heartbeat: {writes / max(total, 1):.4f} "
            f"({writes} rows over {total} heartbeats)"
        )
        return closed_rate if errors + closed_errors == 0 else -1
    finally:
        for d in daphnes:
            d.terminate()
        for d in daphnes:
            d.wait(timeout=10)
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
