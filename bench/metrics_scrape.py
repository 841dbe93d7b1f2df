"""/metrics scrape cost with 1,000 simulated nodes, against a bare /health request in the same run.

Run: ``python bench/metrics_scrape.py [--nodes 1000] [--repeat 60]``. It builds a throwaway SQLite
database and an embedded Redis in a temporary directory (never your data), fills them with N nodes
(mixed states, each with a heartbeat in the zset and a telemetry hash), deployments with waiting
queues, finished-job histograms and a ledger, then times GET /metrics and GET /health through the
full Django stack (middleware, auth) alternately and prints the medians and their ratio. It also
scrapes a 10-node cluster in the same run, so the growth with cluster size is measured side by
side, and counts the SQL queries of one scrape (they must not grow with the node count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1 << 30
TOKEN = "bench-metrics-token-" + "b" * 20


def setup_environment(tmp: Path) -> Any:
    """A private SQLite file and embedded Redis, configured before Django reads its settings."""
    from racon.embedded import start_redis

    redis = start_redis(data_dir=tmp / "redis")
    os.environ.update(
        {
            "REDIS_URL": redis.url,
            "RACON_VAR_DIR": str(tmp / "var"),
            "METRICS_TOKEN": TOKEN,
            "DEBUG": "false",
            "LOG_LEVEL": "WARNING",
            "ALLOWED_HOSTS": "testserver",
            "CELERY_TASK_ALWAYS_EAGER": "true",
        }
    )
    os.environ.pop("DATABASE_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "racon.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return redis


def populate(*, nodes: int, deployments: int = 20, models: int = 5, accounts: int = 200) -> None:
    """N nodes with heartbeats, deployments with queues, finished-job metrics and a ledger."""
    from django.utils import timezone

    from agent.protocol import HEARTBEATS_ZSET, heartbeat_key
    from apps.api.metrics import job_finished_observe
    from apps.credits.ledger import account_create
    from apps.credits.models import Account
    from apps.jobs.models import Deployment, Job
    from apps.models_repo.models import Model, ModelFile
    from apps.nodes.models import Node
    from apps.nodes.states import NodeState
    from racon.redis import get_redis

    now = timezone.now()
    owner = Account.objects.create(name=f"owner-{uuid.uuid4().hex[:6]}")
    states = [NodeState.READY] * 7 + [NodeState.BUSY, NodeState.DEGRADED, NodeState.OFFLINE]
    rows = [
        Node(
            name=f"node-{i}",
            machine_id=uuid.uuid4().hex,
            account=owner,
            state=states[i % len(states)],
            state_changed_at=now,
            credential_hash="0" * 64,
            address=f"10.{i // 250}.{i % 250}.1",
            rpc_port=50052,
            cpu_physical_cores=8,
            cpu_logical_cores=16,
            ram_total=32 * GIB,
            ram_available=20 * GIB,
            vram_total=(24 * GIB if i % 4 == 0 else 0),
            vram_free=(20 * GIB if i % 4 == 0 else 0),
            gpu_count=int(i % 4 == 0),
            hardware={"cpu": {"model": "bench"}, "gpus": []},
        )
        for i in range(nodes)
    ]
    Node.objects.bulk_create(rows, batch_size=500)
    r = get_redis()
    ts = time.time()
    with r.pipeline(transaction=False) as pipe:
        for i, n in enumerate(rows):
            pipe.zadd(HEARTBEATS_ZSET, {str(n.id): ts - (i % 30)})
            pipe.hset(
                heartbeat_key(str(n.id)),
                mapping={
                    "at": ts,
                    "mem_available": 18 * GIB,
                    "gpu_free": str(19 * GIB) if i % 4 == 0 else "",
                    "telemetry": "{}",
                },
            )
        pipe.execute()
    for m in range(models):
        model = Model.objects.create(name=f"bench-model-{m}-{uuid.uuid4().hex[:4]}")
        mf = ModelFile.objects.create(
            model=model, file_name="m.gguf", sha256=uuid.uuid4().hex + uuid.uuid4().hex, size=1
        )
        for d in range(deployments // models):
            dep = Deployment.objects.create(
                model=model, model_file=mf, state="READY", primary=rows[d]
            )
            r.zadd(f"racon:dep:{dep.id}:waiting", {f"w{k}": k for k in range(3)})
        jobs = [Job(model=model, state="RUNNING", queued_at=now) for _ in range(50)]
        Job.objects.bulk_create(jobs)
        for j in jobs[:20]:
            job_finished_observe(
                job_id=j.id,
                state="COMPLETED",
                fields={"completion_tokens": 100, "ttft_ms": 150.0, "tokens_per_s": 30.0},
            )
    for a in range(accounts):
        account_create(name=f"bench-user-{a}-{uuid.uuid4().hex[:4]}", now=now)


def time_requests(client: Any, *, repeat: int) -> tuple[list[float], list[float]]:
    """Alternate /health and /metrics so both see the same machine state; returns seconds each."""
    health, metrics = [], []
    auth = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    from racon.redis import get_redis

    get_redis().set("racon:celery:alive", time.time())  # /health answers 200 as in production
    for _ in range(3):  # warm caches, connections and imports
        client.get("/health")
        assert client.get("/metrics", **auth).status_code == 200
    for _ in range(repeat):
        t = time.perf_counter()
        client.get("/health")
        health.append(time.perf_counter() - t)
        t = time.perf_counter()
        resp = client.get("/metrics", **auth)
        metrics.append(time.perf_counter() - t)
        assert resp.status_code == 200
    return health, metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="racon-bench-metrics-") as tmp:
        redis = setup_environment(Path(tmp))
        try:
            from django.db import connection
            from django.test import Client
            from django.test.utils import CaptureQueriesContext

            from apps.api.metrics import metrics_render
            from apps.nodes.models import Node

            client = Client()
            populate(nodes=10)
            h_small, m_small = time_requests(client, repeat=args.repeat)
            populate(nodes=args.nodes - 10)
            h_big, m_big = time_requests(client, repeat=args.repeat)
            with CaptureQueriesContext(connection) as ctx:
                body = metrics_render()
            med = statistics.median
            print(
                f"nodes: {Node.objects.count()}, exposition: {len(body) / 1024:.1f} KiB, "
                f"SQL queries per scrape: {len(ctx.captured_queries)}"
            )
            print(
                f"GET /health  median {med(h_big) * 1000:7.2f} ms, min {min(h_big) * 1000:6.2f} ms (baseline)"
            )
            print(
                f"GET /metrics median {med(m_big) * 1000:7.2f} ms, "
                f"min {min(m_big) * 1000:6.2f} ms with {args.nodes} nodes"
            )
            print(
                f"GET /metrics median {med(m_small) * 1000:7.2f} ms, min {min(m_small) * 1000:6.2f} ms with 10 nodes"
            )
            # Medians of alternated requests, and minimums (the least disturbed by other load).
            print(
                f"ratio /metrics ÷ /health at {args.nodes} nodes: "
                f"median {med(m_big) / med(h_big):.1f}x, min {min(m_big) / min(h_big):.1f}x"
            )
            print(
                f"ratio /metrics at {args.nodes} nodes ÷ at 10 nodes: "
                f"median {med(m_big) / med(m_small):.2f}x, min {min(m_big) / min(m_small):.2f}x"
            )
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
