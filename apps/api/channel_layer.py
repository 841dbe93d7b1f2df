"""The Channels layer of the live UI: channels_redis with a socket timeout above its blocking pop,
and a receive that outlives a slow Redis.

channels_redis waits for a consumer's next message with BZPOPMIN for ``brpop_timeout`` (5 s) at a
time; with the client's own 5 s socket timeout the read could give up first ("Timeout reading
from ..."), and the exception killed the consumer with a traceback for every open page. Here the
socket timeout is longer than the pop (settings.CHANNEL_LAYERS), and a timeout or a dropped
connection that still happens (Redis busy or restarting) is retried with a backoff and logged as
one line; messages are not lost meanwhile (channels_redis keeps a backup queue).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from channels_redis.core import RedisChannelLayer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("racon.ws")

RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)


class RetryingRedisChannelLayer(RedisChannelLayer):
    async def receive(self, channel: str) -> Any:
        failures = 0
        while True:
            try:
                return await super().receive(channel)
            except (RedisTimeoutError, RedisConnectionError) as exc:
                delay = RETRY_DELAYS[min(failures, len(RETRY_DELAYS) - 1)]
                failures += 1
                log.warning(
                    "channel layer: Redis %s (%s); retrying in %.1f s (try %d)",
                    "timed out" if isinstance(exc, RedisTimeoutError) else "unreachable",
                    str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__,
                    delay,
                    failures,
                )
                await asyncio.sleep(delay)
