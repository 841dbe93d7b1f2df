"""Process-wide Redis clients (sync for services and tasks, asyncio for async views)."""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio as aredis
from django.conf import settings

_lock = threading.Lock()
_sync: dict[str, redis.Redis] = {}
_async: dict[tuple[str, int], aredis.Redis] = {}


def get_redis() -> redis.Redis:
    url = settings.REDIS_URL
    client = _sync.get(url)
    if client is None:
        with _lock:
            client = _sync.get(url)
            if client is None:
                client = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)
                _sync[url] = client
    return client


def get_redis_blocking() -> redis.Redis:
    """A client for blocking reads (BLPOP, XREAD BLOCK): no socket timeout under the block time.

    redis-py 8 defaults to a 5 s socket timeout, which would cut a longer blocking call.
    """
    url = settings.REDIS_URL
    key = "blocking:" + url
    client = _sync.get(key)
    if client is None:
        with _lock:
            client = _sync.get(key)
            if client is None:
                client = redis.Redis.from_url(
                    url, decode_responses=True, socket_timeout=None, health_check_interval=30
                )
                _sync[key] = client
    return client


def get_async_redis() -> aredis.Redis:
    """One asyncio client per event loop: a client's connections belong to the loop that made them."""
    url = settings.REDIS_URL
    key = (url, id(asyncio.get_running_loop()))
    client = _async.get(key)
    if client is None:
        # No socket timeout: stream reads block (XREAD BLOCK) for up to a second at a time.
        client = aredis.Redis.from_url(
            url, decode_responses=True, max_connections=512, socket_timeout=None
        )
        _async[key] = client
    return client
