from __future__ import annotations

import logging

import httpx
import pytest

from agent.client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailable,
    NodeRevoked,
    Unauthorized,
)
from agent.retry import backoff_delay


def make(handler, **kw) -> tuple[ControllerClient, list[float]]:  # type: ignore[no-untyped-def]
    sleeps: list[float] = []
    client = ControllerClient(
        "http://ctl.test", transport=httpx.MockTransport(handler), sleep=sleeps.append, **kw
    )
    return client, sleeps


def test_5xx_is_retried_with_growing_backoff_then_succeeds() -> None:
    answers = iter([503, 502, 500, 200])

    def handler(request: httpx.Request) -> httpx.Response:
        code = next(answers)
        return httpx.Response(
            code, json={"state": "READY", "heartbeat_interval": 5} if code == 200 else {}
        )

    client, sleeps = make(handler, max_retries=5, backoff_base=0.5, backoff_cap=30)
    client.set_credentials("n1", "c1")
    resp = client.report({"id": "r", "kind": "event", "payload": {}})
    assert resp["state"] == "READY"
    assert len(sleeps) == 3
    assert sleeps[0] <= 0.5 and sleeps[2] > sleeps[0]  # jittered exponential growth


def test_retries_are_bounded_and_then_raise_unavailable() -> None:
    client, sleeps = make(lambda r: httpx.Response(503), max_retries=3, backoff_cap=2.0)
    with pytest.raises(ControllerUnavailable, match="HTTP 503"):
        client.report({"id": "r", "kind": "event", "payload": {}})
    assert len(sleeps) == 3
    assert all(s <= 2.0 for s in sleeps)


def test_connection_errors_are_retried_like_5xx() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client, sleeps = make(handler, max_retries=2)
    with pytest.raises(ControllerUnavailable, match="ConnectError"):
        client.health(retries=2)
    assert len(sleeps) == 2


def test_outage_logs_one_line_per_state_change_not_per_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = {"v": False}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={}) if up["v"] else httpx.Response(503)

    client, _ = make(handler, max_retries=4)
    with caplog.at_level(logging.INFO, logger="agent.client"):
        for _ in range(3):
            with pytest.raises(ControllerUnavailable):
                client.health(retries=4)
        up["v"] = True
        client.health()
        client.health()
    messages = [
        r.getMessage()
        for r in caplog.records
        if r.name == "agent.client" and r.levelno >= logging.INFO
    ]
    assert len(messages) == 2, messages
    assert "unreachable" in messages[0] and "HTTP 503" in messages[0]
    assert "reachable again" in messages[1]


def test_node_auth_header_is_sent_on_heartbeats_but_not_enrollment() -> None:
    seen: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = request.headers.get("Authorization")
        if request.url.path.endswith("enroll"):
            return httpx.Response(
                201, json={"node_id": "n", "credential": "c", "redis_url": "redis://x"}
            )
        return httpx.Response(200, json={"state": "READY", "heartbeat_interval": 3})

    client, _ = make(handler)
    client.set_credentials("node-7", "abc")
    client.enroll({"token": "t"})  # type: ignore[typeddict-item]
    client.heartbeat({"telemetry": {}})
    assert seen["/api/agent/enroll"] is None
    assert seen["/api/agent/heartbeat"] == "Node node-7:abc"


def test_a_stored_credential_is_presented_on_re_enrollment() -> None:
    seen: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = request.headers.get("Authorization")
        return httpx.Response(
            201, json={"node_id": "n", "credential": "c", "redis_url": "redis://x"}
        )

    client, _ = make(handler)
    client.enroll({"token": "t"}, presented=("node-7", "abc"))  # type: ignore[typeddict-item]
    assert seen["/api/agent/enroll"] == "Node node-7:abc"


def test_401_coded_node_revoked_raises_node_revoked() -> None:
    client, sleeps = make(
        lambda r: httpx.Response(
            401, json={"error": {"message": "node was revoked by admin", "code": "node_revoked"}}
        )
    )
    with pytest.raises(NodeRevoked, match="revoked"):
        client.heartbeat({"telemetry": {}})
    assert sleeps == []  # a final answer is never retried


def test_a_401_whose_words_say_revoked_without_the_code_is_not_a_revocation() -> None:
    client, _ = make(
        lambda r: httpx.Response(401, json={"error": {"message": "node was revoked by admin"}})
    )
    with pytest.raises(Unauthorized) as got:
        client.heartbeat({"telemetry": {}})
    assert not isinstance(got.value, NodeRevoked)


def test_other_401_and_4xx_are_final_errors() -> None:
    client, _ = make(lambda r: httpx.Response(401, json={"detail": "bad credential"}))
    with pytest.raises(Unauthorized, match="bad credential"):
        client.heartbeat({"telemetry": {}})
    client, sleeps = make(lambda r: httpx.Response(400, json={"error": "payload invalid"}))
    with pytest.raises(ControllerError, match="HTTP 400"):
        client.report({"id": "r", "kind": "event", "payload": {}})
    assert sleeps == []


def test_enroll_response_without_credentials_is_an_error() -> None:
    client, _ = make(lambda r: httpx.Response(201, json={"node_id": "n"}))
    with pytest.raises(ControllerError, match="credential"):
        client.enroll({"token": "t"})  # type: ignore[typeddict-item]


def test_backoff_is_capped() -> None:
    assert all(backoff_delay(n, base=1, cap=5) <= 5 for n in range(40))
    assert backoff_delay(30, base=1, cap=5) >= 2.5
