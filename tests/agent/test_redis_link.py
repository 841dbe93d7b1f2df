"""The agent's Redis link asks the controller for its URL again when the one it holds goes stale
(the controller's embedded Redis starts on another port, without the node's user, at each
`make run`): after REFRESH_AFTER_SECONDS down, at most once per REFRESH_EVERY_SECONDS. Real
redis-servers on loopback; the controller's answer is the callback."""

from __future__ import annotations

import threading
from pathlib import Path

import redis

from agent import redis_link
from agent.redis_link import RedisLink
from racon.embedded import free_port, start_redis


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stale_url_is_replaced_by_the_controllers_and_the_queue_follows(tmp_path: Path) -> None:
    fresh = start_redis(data_dir=tmp_path / "fresh")
    try:
        asked: list[float] = []
        clock = Clock()

        def refresh() -> str:
            asked.append(clock.now)
            return fresh.url

        link = RedisLink(refresh=refresh, clock=clock)
        link.url = f"redis://127.0.0.1:{free_port()}/0"  # the old run's port: nobody there
        stop = threading.Event()
        connected = threading.Thread(target=link.connect, args=("node-1", stop), daemon=True)
        try:
            # connect() retries against the dead port; each failure calls failed().
            link.client = redis.Redis.from_url(link.url, socket_connect_timeout=1)
            link.failed(redis.ConnectionError("refused"))
            clock.now += redis_link.REFRESH_AFTER_SECONDS - 1
            link.failed(redis.ConnectionError("refused"))
            assert asked == []  # a short outage is waited out with the URL it has
            clock.now += 2
            link.failed(redis.ConnectionError("refused"))
            assert asked == [clock.now] and link.url == fresh.url
            assert link.client is not None and link.client.ping()
            clock.now += 5
            link.failed(redis.ConnectionError("refused"))
            assert len(asked) == 1  # at most once per REFRESH_EVERY_SECONDS
            link.mark(True)
            connected.start()
            connected.join(timeout=30)
            assert not connected.is_alive()
            assert link.queue is not None and link.queue.r is link.client
            link.client.lpush(link.queue.queue_key, "{}")
            assert link.queue.r.llen(link.queue.queue_key) == 1
        finally:
            stop.set()
    finally:
        fresh.stop()


def test_the_controller_down_too_keeps_the_url_and_asks_again_later(tmp_path: Path) -> None:
    clock = Clock()
    calls: list[int] = []

    def refresh() -> str:
        calls.append(1)
        raise ConnectionError("controller unreachable")

    link = RedisLink(refresh=refresh, clock=clock)
    link.url = "redis://127.0.0.1:1/0"
    link.failed(redis.ConnectionError("refused"))
    clock.now += redis_link.REFRESH_AFTER_SECONDS
    link.failed(redis.ConnectionError("refused"))
    assert calls == [1] and link.url == "redis://127.0.0.1:1/0"
    clock.now += redis_link.REFRESH_EVERY_SECONDS
    link.failed(redis.ConnectionError("refused"))
    assert calls == [1, 1]


def test_an_operators_redis_url_is_never_replaced() -> None:
    link = RedisLink(refresh=None, clock=Clock())
    link.url = "redis://127.0.0.1:1/0"
    for _ in range(3):
        link.failed(redis.ConnectionError("refused"))
    assert link.url == "redis://127.0.0.1:1/0"
