"""In-process read-through caches with cross-process invalidation over Redis pub/sub.

The hot path of a /v1 request reads three things that change rarely: the API-key principal, the
model by name and the route candidates (docs/design/serving.md, "In-process caches"). Each process
keeps them for ``API_CACHE_SECONDS``. A write that changes one calls :func:`invalidate` with the
cache's name: this process's copy is cleared at once, and after the transaction commits the name
is published on ``racon:cache:invalidate`` so that every other process clears its copy too.

Each process runs one daemon subscriber thread, started on first use (and again in a forked
child, e.g. a Celery prefork worker). Values are only cached while that thread is subscribed: a
process that might miss a message serves from the database instead, so the TTL only bounds a
message lost in flight, never a whole disconnection.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, cast

import redis
from django.conf import settings
from django.db import transaction

from racon.redis import get_redis

log = logging.getLogger("racon.cache")

CHANNEL = "racon:cache:invalidate"
# How long a reader that missed waits for another reader's load of the same key before it loads
# itself (a load is one or two indexed reads; this only bounds a stuck one).
LOAD_WAIT_SECONDS = 5.0
ALL = "*"  # published to clear every cache (used after a bulk change)

_lock = threading.Lock()
_caches: dict[str, TtlCache] = {}
_subscribed = threading.Event()
_subscriber_pid: int | None = None
_subscriber_stop = threading.Event()
# At exit Redis may go first (the test suite's embedded one does): stop listening quietly.
atexit.register(_subscriber_stop.set)


class _Load:
    """One key's load in flight: the readers that miss meanwhile wait for it (single flight)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None


class TtlCache:
    """One named cache: key → (value, expiry). Thread-safe; a None value is cached too.

    One load per key at a time: the requests of a burst that all miss together (the entry expired,
    or was cleared) wait for the first one's load instead of each running it, so a burst of 32
    streams reads the database once, not 32 times, before its prompts leave (bench/relay.py and
    bench/concurrency.py: time to first token at 16-32 streams)."""

    def __init__(self, name: str, max_entries: int = 4096) -> None:
        self.name = name
        self.max_entries = max_entries
        self._data: dict[Hashable, tuple[Any, float]] = {}
        self._loading: dict[Hashable, _Load] = {}
        self._lock = threading.Lock()
        self._generation = 0
        self.hits = 0
        self.misses = 0

    def get[V](self, key: Hashable, loader: Callable[[], V]) -> V:
        ttl = float(settings.API_CACHE_SECONDS)
        if ttl <= 0 or not _subscriber_ensure():
            return loader()
        now = time.monotonic()
        with self._lock:
            got = self._data.get(key)
            if got is not None and got[1] > now:
                self.hits += 1
                return got[0]
            generation = self._generation
            self.misses += 1
            load = self._loading.get(key)
            mine = load is None
            if load is None:
                load = self._loading[key] = _Load()
        if not mine:
            # Another reader's load began before this miss: its value is as fresh as our own
            # load would be. If it failed (or hangs), load here.
            if load.done.wait(LOAD_WAIT_SECONDS) and load.ok:
                return cast("V", load.value)
            return loader()
        try:
            load.value = loader()
            load.ok = True
        finally:
            # Done either way: on a failure the waiters load themselves (and the error propagates).
            with self._lock:
                if self._loading.get(key) is load:
                    del self._loading[key]
                load.done.set()
                # An invalidation that arrived while the loader ran may describe a write the
                # loader did not see: keep the value out of the cache then (the next read loads).
                if load.ok and generation == self._generation:
                    if len(self._data) >= self.max_entries:
                        # Bounded: unknown keys are cached too (as None), so a flood of them must
                        # not grow the process.
                        self._data = {k: v for k, v in self._data.items() if v[1] > now}
                        if len(self._data) >= self.max_entries:
                            self._data.clear()
                    self._data[key] = (load.value, now + ttl)
        return cast("V", load.value)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._loading.clear()  # a load begun before the write: later misses load anew
            self._generation += 1

    def __len__(self) -> int:
        return len(self._data)


def cache(name: str) -> TtlCache:
    """The process's cache of this name (created on first use)."""
    got = _caches.get(name)
    if got is None:
        with _lock:
            got = _caches.setdefault(name, TtlCache(name))
    return got


def cached[T](name: str, key: Hashable, loader: Callable[[], T]) -> T:
    """Read through the named cache."""
    return cache(name).get(key, loader)


def clear_local(name: str) -> None:
    """Clear this process's copy of one cache (or all with ``"*"``), without telling anyone."""
    if name == ALL:
        for c in list(_caches.values()):
            c.clear()
    elif name in _caches:
        _caches[name].clear()


def invalidate(*names: str) -> None:
    """Clear the named caches here now, and in every process once the current transaction commits.

    Outside a transaction the broadcast goes at once. The local clear runs again after commit: a
    read in this process between the write and the commit could have cached the old row.
    """
    for name in names:
        clear_local(name)

    def after_commit() -> None:
        for name in names:
            clear_local(name)
            publish(name)

    transaction.on_commit(after_commit)


def publish(name: str) -> None:
    """Broadcast one cache name; a lost message is bounded by API_CACHE_SECONDS, so never raise."""
    try:
        get_redis().publish(CHANNEL, name)
    except redis.RedisError:
        log.warning(
            "cache invalidation for %r not published; other processes see it within %ss",
            name,
            settings.API_CACHE_SECONDS,
            exc_info=True,
        )


def subscriber_ready(timeout: float = 0.0) -> bool:
    """Whether this process's subscriber is listening (waits up to ``timeout`` seconds)."""
    _subscriber_ensure()
    return _subscribed.wait(timeout) if timeout else _subscribed.is_set()


def subscriber_stop() -> None:
    """End this process's subscriber quietly: for a process about to stop its own Redis (a
    bench), whose subscriber would otherwise log the lost connection."""
    _subscriber_stop.set()


def _subscriber_ensure() -> bool:
    """Start the subscriber thread once per process; True when it is subscribed."""
    global _subscriber_pid
    pid = os.getpid()
    if _subscriber_pid != pid:
        with _lock:
            if _subscriber_pid != pid:
                # A forked child inherits the flag but not the thread, nor its socket.
                _subscribed.clear()
                for c in _caches.values():
                    c.clear()
                _subscriber_pid = pid
                threading.Thread(
                    target=_subscriber_run, name="racon-cache-invalidate", daemon=True
                ).start()
    return _subscribed.is_set()


def _subscriber_run() -> None:
    backoff = 0.5
    while not _subscriber_stop.is_set():
        pubsub = None
        try:
            client = redis.Redis.from_url(
                settings.REDIS_URL,
                decode_responses=True,
                socket_timeout=10,
                socket_connect_timeout=5,
                health_check_interval=5,
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(CHANNEL)
            # Anything published while we were not listening is lost: start from empty caches.
            clear_local(ALL)
            _subscribed.set()
            backoff = 0.5
            while not _subscriber_stop.is_set():
                msg = pubsub.get_message(timeout=1.0)
                if msg is not None and msg.get("type") == "message":
                    clear_local(str(msg.get("data") or ALL))
        except Exception:  # the thread must outlive any Redis fault
            if _subscribed.is_set() and not _subscriber_stop.is_set():
                log.warning(
                    "cache invalidation subscriber lost Redis; caching paused until it reconnects",
                    exc_info=True,
                )
        finally:
            _subscribed.clear()
            clear_local(ALL)
            if pubsub is not None:
                try:
                    pubsub.close()
                except Exception:
                    pass
        _subscriber_stop.wait(backoff)
        backoff = min(5.0, backoff * 2)
