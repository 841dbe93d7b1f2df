"""A stream follower and the process-wide clients live through a restart of Redis.

Destructive: a private redis-server of the test's own (CLARIFICATIONS, "Tests and time"), on a
port in 19500-19599, with appendonly as the launcher's embedded one, killed with SIGKILL under a
live follower and started again on the same port and data.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from agent.protocol import job_stream_key
from apps.jobs.streams import StreamFollower
from racon.embedded import EmbeddedRedis, start_redis
from racon.ids import JobId, NodeId
from racon.redis import get_async_redis, get_redis

NODE = "node-restart"


def free_port() -> int:
    for port in range(19540, 19600):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 19540-19599")


@pytest.fixture
def private_redis(tmp_path: Path, settings: Any) -> Any:
    srv = start_redis(data_dir=tmp_path / "redis", port=free_port(), appendonly=True)
    settings.REDIS_URL = srv.url
    try:
        yield srv
    finally:
        srv.stop()


def entry(seq: int, kind: str = "chunk") -> dict[str, str]:
    fields = {"seq": str(seq), "attempt": "1", "type": kind, "text": f"t{seq} ", "n": "1"}
    if kind == "done":
        fields.update(finish_reason="stop", usage="{}")
    return fields


def kill_and_restart(srv: EmbeddedRedis, *, down_s: float) -> None:
    time.sleep(1.2)  # appendfsync everysec: what was written is on disk, as in production
    os.kill(srv.process.pid, signal.SIGKILL)
    srv.process.wait()
    time.sleep(down_s)
    srv.restart()


def test_a_follower_reads_on_through_a_redis_kill_and_restart(private_redis: EmbeddedRedis) -> None:
    job_id = str(uuid.uuid4())
    key = job_stream_key(job_id, NODE)
    r = get_redis()
    for seq in range(3):
        r.xadd(key, entry(seq))
    got: list[str] = []

    def writer() -> None:
        while not got:  # the first three entries, relayed (as one chunk: read together)
            time.sleep(0.05)
        kill_and_restart(private_redis, down_s=4.0)  # past redis-py's default retries
        w = get_redis()  # the same pooled client as before the kill: it reconnects
        for seq in range(3, 6):
            w.xadd(key, entry(seq))
        w.xadd(key, entry(6, "done"))

    async def follow() -> None:
        follower = StreamFollower(
            job_id=JobId(job_id), deployment_id=None, node_id=NodeId(NODE), idle_timeout=30
        )
        async for fields in follower.entries():
            got.append(fields["seq"])
        assert follower.completion_tokens == 6
        assert await get_async_redis().ping()  # the async client's pool is usable again

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    asyncio.run(asyncio.wait_for(follow(), timeout=90))
    t.join(timeout=30)
    # Every entry once, in order, and the end (chunks read together are relayed as one, under
    # the newest one's seq; completion_tokens == 6 above counts each chunk once).
    assert [int(s) for s in got] == sorted({int(s) for s in got}) and got[-1] == "6"
