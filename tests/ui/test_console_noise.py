"""No console noise: no Cross-Origin-Opener-Policy over plain http, and a slow Redis on the WebSocket
path is retried and logged as one line, never a traceback that ends the socket."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels_redis.core import RedisChannelLayer
from django.test import Client
from redis.exceptions import TimeoutError as RedisTimeoutError

from apps.api import channel_layer, consumers


@pytest.mark.django_db
def test_plain_http_pages_carry_no_cross_origin_opener_policy(settings: Any) -> None:
    assert settings.SECURE_CROSS_ORIGIN_OPENER_POLICY is None  # RACON_TLS is off here
    resp = Client().get("/login/")
    assert resp.status_code == 200
    assert "Cross-Origin-Opener-Policy" not in resp.headers


def test_the_channel_layer_retries_a_redis_timeout_and_logs_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = {"n": 0}

    async def flaky(self: Any, channel: str) -> dict[str, str]:
        calls["n"] += 1
        if calls["n"] < 3:
            raise RedisTimeoutError("Timeout reading from 127.0.0.1:6379")
        return {"type": "node.changed"}

    monkeypatch.setattr(RedisChannelLayer, "receive", flaky)
    monkeypatch.setattr(channel_layer, "RETRY_DELAYS", (0.0,))
    layer = channel_layer.RetryingRedisChannelLayer(hosts=["redis://127.0.0.1:6379/11"])
    with caplog.at_level(logging.WARNING, logger="racon.ws"):
        got = async_to_sync(layer.receive)("specific.abc!xyz")
    assert got == {"type": "node.changed"} and calls["n"] == 3
    lines = [r for r in caplog.records if r.name == "racon.ws"]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)
    assert "timed out" in lines[0].getMessage() and "\n" not in lines[0].getMessage()


def test_a_consumer_read_that_keeps_timing_out_is_skipped_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(consumers, "RETRY_DELAYS", (0.0, 0.0))

    async def slow() -> str:
        raise RedisTimeoutError("Timeout reading from 127.0.0.1:6379")

    with caplog.at_level(logging.WARNING, logger="racon.ws"):
        got = async_to_sync(consumers._retrying)("node row", slow)
    assert got is None
    lines = [r for r in caplog.records if r.name == "racon.ws"]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "after 3 tries" in lines[0].getMessage()
