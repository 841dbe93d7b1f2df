"""Process-wide Redis clients (sync for services and tasks, asyncio for async views)."""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio as aredis
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# A restart of Redis (the launcher brings the embedded one back within a few seconds) must not
# reach callers as "Connection lost": every command is retried on a new connection with capped
# exponential backoff, 0.05 s doubling to 1 s, for about 17 s in all.
# redis-py's default (10 tries from 10 ms with jitter) gives up after 2-3 s, before a restarted
# Redis has reloaded its appendonly file. Idle pooled connections are pinged before reuse
# (HEALTH_CHECK_SECONDS), so a connection from before the restart is replaced, not used.
RETRY_BASE_SECONDS = 0.05
RETRY_CAP_SECONDS = 1.0
RETRY_COUNT = 20
HEALTH_CHECK_SECONDS = 15
# What a caller that outlives the client's own retries (a stream follower) may retry itself.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)


def _retry() -> Retry:
    return Retry(
        ExponentialBackoff(cap=RETRY_CAP_SECONDS, base=RETRY_BASE_SECONDS),
        RETRY_COUNT,
        supported_errors=(RedisConnectionError, RedisTimeoutError),
    )


def _async_retry() -> AsyncRetry:
    return AsyncRetry(
        ExponentialBackoff(cap=RETRY_CAP_SECONDS, base=RETRY_BASE_SECONDS),
        RETRY_COUNT,
        supported_errors=(RedisConnectionError, RedisTimeoutError),
    )


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
                client = redis.Redis.from_url(
                    url,
                    decode_responses=True,
                    health_check_interval=HEALTH_CHECK_SECONDS,
                    retry=_retry(),
                )
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
                    url,
                    decode_responses=True,
                    socket_timeout=None,
                    health_check_interval=HEALTH_CHECK_SECONDS,
                    retry=_retry(),
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
            url,
            decode_responses=True,
            max_connections=512,
            socket_timeout=None,
            health_check_interval=HEALTH_CHECK_SECONDS,
            retry=_async_retry(),
        )
        _async[key] = client
    return client
