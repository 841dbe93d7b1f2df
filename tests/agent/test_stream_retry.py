"""The stream writer lives through a Redis restart: it retries, in order, without duplicates.

Destructive: a private redis-server of the test's own (racon/embedded.py, on an ephemeral port,
appendonly as the launcher's embedded one), killed with SIGKILL under a live writer and started
again on the same port and data. The duplicate case goes through a real TCP proxy that lets a
transaction reach Redis and then cuts the connection before its reply: what a kill at the wrong
moment does.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from agent.protocol import StreamEntry, job_stream_key
from agent.runtime.stream import DirectStreamWriter, StreamWriter, entry
from racon.embedded import EmbeddedRedis, start_redis

NODE = "node-stream-retry"
USAGE = {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    srv = start_redis(data_dir=tmp_path / "redis", appendonly=True)
    try:
        yield srv
    finally:
        srv.stop()


def agent_client(url: str) -> redis.Redis:
    """A client set up as the agent's (agent/redis_link.py)."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=15, socket_connect_timeout=5
    )


def kill(srv: EmbeddedRedis) -> None:
    time.sleep(1.2)  # appendfsync everysec: what was written is on disk, as in production
    os.kill(srv.process.pid, signal.SIGKILL)
    srv.process.wait()


def seqs(client: redis.Redis, job_id: str) -> list[tuple[str, str]]:
    rows = client.xrange(job_stream_key(job_id, NODE))
    return [(f["seq"], f["type"]) for _id, f in rows]


def expected(n_chunks: int) -> list[tuple[str, str]]:
    return [*((str(i), "chunk") for i in range(n_chunks)), (str(n_chunks), "done")]


@pytest.mark.parametrize("writer_class", [StreamWriter, DirectStreamWriter])
def test_a_writer_streams_on_through_a_redis_kill_and_restart(
    private_redis: EmbeddedRedis, writer_class: type[StreamWriter]
) -> None:
    client = agent_client(private_redis.url)
    job_id = str(uuid.uuid4())
    cancel = threading.Event()
    w = writer_class(client, job_id, cancel, node_id=NODE)
    for i in range(3):
        w.chunk(f"t{i} ", [i])
    kill(private_redis)  # after those are on disk
    # Down for 3 s: past redis-py's own retries (about 2 s), within the writer's.
    restarter = threading.Timer(3.0, private_redis.restart)
    restarter.start()
    try:
        t0 = time.monotonic()
        for i in range(3, 6):
            w.chunk(f"t{i} ", [i])  # written while Redis is down (a DirectStreamWriter waits here)
        w.done("stop", USAGE)  # type: ignore[arg-type]
        took = time.monotonic() - t0
    finally:
        restarter.join()
    assert w.error is None, w.error
    assert not cancel.is_set()
    assert seqs(client, job_id) == expected(6)
    assert took < 10 * 20.0  # bounded by the retry window (generous: shared cores)
    client.close()


def test_a_write_gives_up_after_its_retry_window(private_redis: EmbeddedRedis) -> None:
    client = agent_client(private_redis.url)
    job_id = str(uuid.uuid4())
    cancel = threading.Event()
    w = StreamWriter(client, job_id, cancel, node_id=NODE, retry_seconds=1.0)
    w.chunk("a", [1])
    kill(private_redis)  # and never back
    t0 = time.monotonic()
    w.chunk("b", [2])
    w.close()
    took = time.monotonic() - t0
    assert w.error is not None and w.error.startswith("stream write failed"), w.error
    assert cancel.is_set()  # generation stops
    assert took < 60.0  # the window is 1 s, plus redis-py's own retries of each try
    client.close()


class CutAfterExec:
    """A TCP proxy to Redis that, once armed, forwards one transaction's EXEC and then closes the
    client's connection instead of passing EXEC's reply on: the transaction ran, the client never
    heard. Everything else passes through untouched."""

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.cuts = 0
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self._socks += [conn, up]
            sent_exec = threading.Event()
            threading.Thread(target=self._up, args=(conn, up, sent_exec), daemon=True).start()
            threading.Thread(target=self._down, args=(up, conn, sent_exec), daemon=True).start()

    def _up(self, conn: socket.socket, up: socket.socket, sent_exec: threading.Event) -> None:
        try:
            while data := conn.recv(65536):
                if self.armed.is_set() and b"EXEC" in data.upper():
                    sent_exec.set()  # before it goes: every reply from here on is to it
                up.sendall(data)
        except OSError:
            pass

    def _down(self, up: socket.socket, conn: socket.socket, sent_exec: threading.Event) -> None:
        try:
            while data := up.recv(65536):
                # EXEC's reply is an array ("*"), after MULTI's +OK and a +QUEUED per command:
                # once it is there the transaction has run.
                if sent_exec.is_set() and self.armed.is_set() and b"\r\n*" in data:
                    self.armed.clear()
                    self.cuts += 1
                    conn.shutdown(socket.SHUT_RDWR)
                    conn.close()
                    up.close()
                    return
                conn.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            s.close()


def test_a_batch_whose_reply_was_lost_is_not_written_twice(
    private_redis: EmbeddedRedis,
) -> None:
    proxy = CutAfterExec(private_redis.port)
    client = agent_client(f"redis://127.0.0.1:{proxy.port}/0")
    direct = agent_client(private_redis.url)
    job_id = str(uuid.uuid4())
    try:
        w = DirectStreamWriter(client, job_id, threading.Event(), node_id=NODE)
        w.chunk("a", [1])
        proxy.armed.set()
        w.chunk("b", [2])  # lands, its reply is cut; the retry reads back and sends nothing
        w.chunk("c", [3])
        w.done("stop", USAGE)  # type: ignore[arg-type]
        assert proxy.cuts == 1
        assert w.error is None, w.error
        assert seqs(direct, job_id) == expected(3)
    finally:
        client.close()
        direct.close()
        proxy.close()


def test_the_read_back_counts_only_this_attempts_entries(private_redis: EmbeddedRedis) -> None:
    """Two attempts on one node share the key: what attempt 2 finds of its batch is its own."""
    client = agent_client(private_redis.url)
    job_id = str(uuid.uuid4())
    first = StreamWriter(client, job_id, threading.Event(), node_id=NODE, start=False)
    first._write(_chunks(first, 5))
    second = StreamWriter(client, job_id, threading.Event(), node_id=NODE, attempt=2, start=False)
    batch = _chunks(second, 3)
    assert second._not_landed(batch) == batch  # attempt 1's seq 4 is not attempt 2's
    second._write(batch[:2])
    assert second._not_landed(batch) == batch[2:]
    client.close()


def _chunks(w: StreamWriter, n: int) -> list[StreamEntry]:
    return [entry(w._next(), "chunk", f"t{i}", ids=[i], attempt=w.attempt) for i in range(n)]
