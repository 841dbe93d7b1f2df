"""A Redis lock that expires, so a dead holder frees it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import LockError

from racon.redis import get_redis

log = logging.getLogger("racon.locks")


@contextmanager
def redis_lock(name: str, *, timeout: float) -> Iterator[bool]:
    """Hold a Redis lock (expiring after timeout, so a dead holder frees it); yields whether it
    was acquired: after waiting timeout for it, the caller goes on unlocked rather than fail."""
    lock = get_redis().lock(name, timeout=timeout, blocking_timeout=timeout)
    acquired = bool(lock.acquire())
    if not acquired:
        log.warning("lock %s not acquired within %.0fs; going on without it", name, timeout)
    try:
        yield acquired
    finally:
        if acquired:
            try:
                lock.release()
            except LockError:
                pass  # expired meanwhile: someone else may hold it now, and that is theirs
