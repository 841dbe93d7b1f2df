"""Per-request cost: database queries, Redis commands and CPU of one /v1 request's own work.

Run: ``python bench/request_cost.py [--requests 200]``.

What a request costs apart from its tokens, step by step, in one process and without a live
cluster: its own SQLite database and embedded Redis (as ``make run`` and the benches use), one
READY deployment with a free slot, a funded account and its API key. Each request goes the
production path of the /v1 view's synchronous steps, called directly:

- ``admit``: authenticate, validate, route, quotas, the credit hold, the job's row and the
  run_job push (``apps.api.v1.views._authorize_and_admit``, the fast path);
- ``first token``: the job marked RUNNING (``job_mark_running``);
- ``finish``: the job's end recorded with the controller's count (``serving.admission_finish``),
  as the stream's ``done`` entry makes the view do;
- ``settle``: the Celery task's work (``credit_settle_job``).

Printed per step: queries, Redis round trips (the client's sends) and CPU milliseconds (the
process's thread time), each per request. Figures, not goals: bench/relay.py measures the same
work across the real processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


_sends = [0]


def _count_round_trips() -> None:
    """Count the Redis client's sends: one per command, one per pipeline (a round trip each)."""
    import redis.connection

    cls: Any = redis.connection.AbstractConnection
    orig = cls.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        _sends[0] += 1
        orig(self, command, check_health)

    cls.send_packed_command = counted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--sql", action="store_true", help="print the last request's queries")
    args = p.parse_args()
    os.environ["RACON_BENCH_SQL"] = "1" if args.sql else ""

    workdir = Path(tempfile.mkdtemp(prefix="racon-reqcost-"))
    from racon.embedded import start_redis

    embedded = start_redis(data_dir=workdir / "redis")
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "racon.settings",
            "REDIS_URL": embedded.url,
            "CELERY_BROKER_URL": embedded.url.rsplit("/", 1)[0] + "/1",
            "RACON_VAR_DIR": str(workdir / "var"),
            "DATABASE_URL": f"sqlite:///{(workdir / 'bench.sqlite3').resolve()}",
            "DEBUG": "false",
            "AI_API_KEY": "bench-operator-key-0123456789",
            "NODE_ENROLLMENT_SECRET": "bench-enrollment-secret-0123456789",
            "LOG_LEVEL": "WARNING",
        }
    )
    try:
        return _run(args.requests, embedded)
    finally:
        from racon.cache import subscriber_stop

        subscriber_stop()
        embedded.stop()


def _run(n: int, embedded: Any) -> int:
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from apps.api.v1 import views
    from apps.credits.settlement import credit_settle_job
    from apps.jobs import serving, streams
    from apps.jobs.jobs import job_mark_running
    from apps.jobs.models import Deployment
    from tests.factories import funded_account, key_for, live_deployment

    dep = live_deployment(n_ctx=4096)
    Deployment.objects.filter(pk=dep.pk).update(n_parallel=max(4, n + 1))
    account = funded_account(10**12)
    header = key_for(account)["HTTP_AUTHORIZATION"]
    body = {
        "model": "live-model",
        "prompt": "Per-request cost.",
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    steps = ("admit", "first token", "finish", "settle")
    queries = dict.fromkeys(steps, 0)
    redis_calls = dict.fromkeys(steps, 0)
    cpu = dict.fromkeys(steps, 0.0)

    _count_round_trips()
    last: dict[str, list[str]] = {}

    def measure(step: str, fn: Any) -> Any:
        before_r = _sends[0]
        t0 = time.thread_time()
        with CaptureQueriesContext(connection) as q:
            out = fn()
        cpu[step] += time.thread_time() - t0
        redis_calls[step] += _sends[0] - before_r
        queries[step] += len(q.captured_queries)
        last[step] = [x["sql"][:160] for x in q.captured_queries]
        return out

    def one(i: int) -> None:
        _, adm = measure(
            "admit",
            lambda: views._authorize_and_admit(
                header=header, kind="completion", body=dict(body), request_id=f"r{i}"
            ),
        )
        assert adm.dispatched, "the bench's deployment had no free slot"
        measure("first token", lambda: job_mark_running(job_id=adm.job_id, now=timezone.now()))
        follower = streams.StreamFollower(
            job_id=adm.job_id,
            deployment_id=adm.deployment_id,
            node_id=adm.primary_id,
            prompt_bound=adm.prompt_bound,
            max_tokens=1,
        )
        follower.chunks = follower.completion_tokens = follower.attempt_tokens = 1
        adm.follower = follower
        done = {"type": "done", "finish_reason": "length", "usage": ""}
        measure(
            "finish",
            lambda: serving.admission_finish(
                adm=adm, outcome="completed", entry=done, finish_reason="length"
            ),
        )
        measure("settle", lambda: credit_settle_job(job_id=adm.job_id, now=timezone.now()))

    for i in range(5):  # warm: caches, prepared scripts, the system accounts
        one(-1 - i)
    for k in steps:
        queries[k], redis_calls[k], cpu[k] = 0, 0, 0.0
    for i in range(n):
        one(i)
    print(f"per request, over {n} one-token requests (SQLite, embedded Redis, one process):")
    print(f"  {'step':<12} {'queries':>8} {'redis trips':>10} {'CPU ms':>8}")
    for k in steps:
        print(
            f"  {k:<12} {queries[k] / n:>8.1f} {redis_calls[k] / n:>10.1f} {1e3 * cpu[k] / n:>8.2f}"
        )
    print(
        f"  {'total':<12} {sum(queries.values()) / n:>8.1f} "
        f"{sum(redis_calls.values()) / n:>10.1f} {1e3 * sum(cpu.values()) / n:>8.2f}"
    )
    if os.environ.get("RACON_BENCH_SQL"):
        for k in steps:
            print(f"-- {k}")
            for sql in last.get(k, []):
                print(f"   {sql}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
