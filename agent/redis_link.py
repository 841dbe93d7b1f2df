"""The agent's Redis connection: the node's command queue, and one log line per change in reach."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import redis

from agent.queue import CommandQueue
from agent.retry import RetryStopped, retry_call
from agent.state import FatalAgentError

log = logging.getLogger("agent")


class RedisLink:
    def __init__(self, ca_file: Path | None = None) -> None:
        self.url = ""
        # The controller's CA: a rediss:// URL is checked against it (a LAN controller's Redis
        # has a certificate from the controller's own CA, racon/tls.py).
        self.ca_file = ca_file
        self.client: redis.Redis | None = None
        self.queue: CommandQueue | None = None
        self._ok: bool | None = None  # None until the first answer or failure

    def connect(self, node_id: str, stop: threading.Event) -> None:
        """Connect and recover commands a crash left in processing, retrying until `stop`."""
        if not self.url:
            raise FatalAgentError("the controller gave no Redis URL and --redis-url is not set")
        tls: dict[str, Any] = {}
        if self.url.startswith("rediss://") and self.ca_file is not None:
            tls = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.ca_file)}
        self.client = redis.Redis.from_url(
            self.url,
            decode_responses=True,
            socket_timeout=15,
            socket_connect_timeout=5,
            health_check_interval=30,
            **tls,
        )
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

    def failed(self, exc: BaseException, _failures: int = 0, _delay: float = 0.0) -> None:
        self.mark(False, exc)

    def mark(self, ok: bool, exc: BaseException | None = None) -> None:
        if self._ok is ok:
            return
        before, self._ok = self._ok, ok
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
