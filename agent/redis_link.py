"""The agent's Redis connection: the node's command queue, and one log line per change in reach."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from agent.queue import CommandQueue
from agent.retry import RetryStopped, retry_call
from agent.state import FatalAgentError

log = logging.getLogger("agent")


# After this long unreachable (or refused), the URL is asked of the controller again, at most
# once per REFRESH_EVERY_SECONDS: its Redis may have restarted on another port, without our user.
REFRESH_AFTER_SECONDS = 10.0
REFRESH_EVERY_SECONDS = 30.0


class RedisLink:
    def __init__(
        self,
        ca_file: Path | None = None,
        *,
        refresh: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = ""
        # The controller's CA: a rediss:// URL is checked against it (a LAN controller's Redis
        # has a certificate from the controller's own CA, racon/tls.py).
        self.ca_file = ca_file
        self.client: redis.Redis | None = None
        self.queue: CommandQueue | None = None
        self._ok: bool | None = None  # None until the first answer or failure
        # Asks the controller for the node's Redis URL now (None: an operator's --redis-url).
        self.refresh = refresh
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._refreshed_at: float | None = None

    def connect(self, node_id: str, stop: threading.Event) -> None:
        """Connect and recover commands a crash left in processing, retrying until `stop`."""
        if not self.url:
            raise FatalAgentError("the controller gave no Redis URL and --redis-url is not set")
        self.client = self._client()
        self.queue = CommandQueue(self.client, node_id)
        if stop.is_set():
            return
        try:
            retry_call(
                self.queue.recover,
                retry_on=redis.RedisError,
                base=1.0,
                cap=30.0,
                stop=stop,
                on_retry=self.failed,
            )
        except RetryStopped:
            return
        self.mark(True)

    def _client(self) -> redis.Redis:
        tls: dict[str, Any] = {}
        if self.url.startswith("rediss://") and self.ca_file is not None:
            tls = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.ca_file)}
        return redis.Redis.from_url(
            self.url,
            decode_responses=True,
            socket_timeout=15,
            socket_connect_timeout=5,
            health_check_interval=30,
            **tls,
        )

    def failed(self, exc: BaseException, _failures: int = 0, _delay: float = 0.0) -> None:
        self.mark(False, exc)
        self._maybe_refresh()

    def _maybe_refresh(self) -> None:
        """Down for REFRESH_AFTER_SECONDS: ask the controller for the URL; a new one replaces the
        client under the queue (the loops that retry pick it up on their next try)."""
        if self.refresh is None:
            return
        with self._lock:
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
            if now - self._down_since < REFRESH_AFTER_SECONDS or (
                self._refreshed_at is not None and now - self._refreshed_at < REFRESH_EVERY_SECONDS
            ):
                return
            self._refreshed_at = now
            try:
                url = self.refresh()
            except Exception as exc:  # the controller may be down too: try again later
                log.warning("asking the controller for this node's Redis URL failed: %s", exc)
                return
            if url == self.url:
                return
            log.warning(
                "the controller's Redis moved: %s → %s; reconnecting", redact(self.url), redact(url)
            )
            old, self.url = self.client, url
            self.client = self._client()
            if self.queue is not None:
                self.queue.r = self.client
            if old is not None:
                old.close()

    def mark(self, ok: bool, exc: BaseException | None = None) -> None:
        if self._ok is ok:
            return
        before, self._ok = self._ok, ok
        if ok:
            self._down_since = None
        if ok and before is False:
            log.info("Redis %s is reachable again", redact(self.url))
        elif not ok:
            log.warning("Redis %s unreachable (%s); retrying with backoff", redact(self.url), exc)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def redact(url: str) -> str:
    # redis://:password@host → redis://***@host: logs are shared in doctor bundles.
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
