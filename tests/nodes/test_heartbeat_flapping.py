"""A node flipping BUSY ⇄ READY on every heartbeat, and a node beating as fast as it can (issue 28,
item 2): each test drives the agent's heartbeat endpoint with the node's own credential."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from celery.signals import task_prerun
from django.test import Client
from django.utils import timezone

from agent.protocol import HEARTBEATS_ZSET, PROTOCOL_VERSION, heartbeat_key
from apps.nodes.enrollment import enrollment_token_issue
from apps.nodes.models import Event, Node
from apps.nodes.states import NodeState
from racon import ids
from racon.redis import get_redis
from tests.factories import AccountFactory, hardware_profile

pytestmark = pytest.mark.django_db
S = NodeState
_PORTS = itertools.count(42000)
METRICS_TOKEN = "flap-metrics-token-" + "x" * 24


def enroll(client: Client) -> tuple[str, str]:
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="t", now=timezone.now()
    )
    port = next(_PORTS)
    resp = client.post(
        "/api/agent/enroll",
        {
            "token": token,
            "node_name": f"flapper-{port}",
            "machine_id": f"flapper-{port}",
            "agent_version": "0.1.0",
            "protocol_version": PROTOCOL_VERSION,
            "advertise_address": "127.0.0.1",
            "rpc_port": port,
            "hardware": hardware_profile(),
        },
        content_type="application/json",
    )
    assert resp.status_code == 201, resp.content
    return resp.json()["node_id"], resp.json()["credential"]


def beat(client: Client, node_id: str, cred: str, *, jobs: list[str]) -> Any:
    return client.post(
        "/api/agent/heartbeat",
        {
            "state": "READY",
            "protocol_version": PROTOCOL_VERSION,
            "telemetry": {"cpu_percent": 5.0, "jobs": jobs},
        },
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{cred}"},
    )


@pytest.fixture
def tasks_run() -> Iterator[list[str]]:
    """The names of the Celery tasks run (eager in tests: each one sent runs here)."""
    names: list[str] = []

    def seen(sender: Any = None, **kwargs: Any) -> None:
        names.append(str(getattr(sender, "name", sender)))

    task_prerun.connect(seen, weak=False)
    try:
        yield names
    finally:
        task_prerun.disconnect(seen)


def test_busy_ready_flips_are_counted_not_written_as_events_and_queue_no_work(
    client: Client, settings: Any, tasks_run: list[str]
) -> None:
    settings.SPEED_CHALLENGE = False
    settings.METRICS_TOKEN = METRICS_TOKEN
    settings.NODE_HEARTBEAT_RATE_PER_MINUTE = 1000
    node_id, cred = enroll(client)
    assert beat(client, node_id, cred, jobs=[]).json()["state"] == S.READY
    events_before = Event.objects.filter(node_id=node_id).count()
    tasks_before = len(tasks_run)
    for i in range(20):
        resp = beat(client, node_id, cred, jobs=["j"] if i % 2 == 0 else [])
        assert resp.status_code == 200, resp.content
        assert resp.json()["state"] == (S.BUSY if i % 2 == 0 else S.READY)
    assert Node.objects.get(pk=node_id).state == S.READY
    new_events = list(
        Event.objects.filter(node_id=node_id).values_list("kind", "old_state", "new_state")
    )[events_before:]
    assert new_events == [], new_events
    assert tasks_run[tasks_before:] == []
    scrape = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}")
    assert scrape.status_code == 200
    line = next(
        x for x in scrape.content.decode().splitlines() if x.startswith("racon_node_busy_flips")
    )
    assert float(line.split()[-1]) >= 20


def test_a_node_beating_past_the_rate_gets_429_and_its_beats_change_nothing(
    client: Client, settings: Any
) -> None:
    settings.SPEED_CHALLENGE = False
    settings.NODE_HEARTBEAT_RATE_PER_MINUTE = 10
    node_id, cred = enroll(client)
    codes = [beat(client, node_id, cred, jobs=[]).status_code for _ in range(10)]
    assert codes == [200] * 10
    before = get_redis().zscore(HEARTBEATS_ZSET, node_id)
    refused = beat(client, node_id, cred, jobs=["j"])
    assert refused.status_code == 429, refused.content
    assert refused.json()["error"]["code"] == "rate_limited"
    assert "NODE_HEARTBEAT_RATE_PER_MINUTE" in refused.json()["error"]["message"]
    assert refused.json()["error"]["retry_after"] >= 1
    # The header too, as the /v1 limits answer: a client that reads only headers backs off.
    assert int(refused.headers["Retry-After"]) >= 1, dict(refused.headers)
    assert Node.objects.get(pk=node_id).state == S.READY  # the refused beat's BUSY never landed
    telemetry = get_redis().hgetall(heartbeat_key(node_id))
    assert telemetry["jobs"] == "0"  # nor its telemetry
    # Its arrival is kept: a node that bursts is not taken for a silent one by the health sweep.
    assert get_redis().zscore(HEARTBEATS_ZSET, node_id) >= before


@pytest.mark.django_db(transaction=True)
def test_the_asgi_fast_path_answers_a_beat_past_the_rate_with_retry_after(
    client: Client, settings: Any
) -> None:
    """Under daphne, racon.asgi answers heartbeats before Django: its 429 carries the header too."""
    from asgiref.testing import ApplicationCommunicator

    from racon.asgi import HEARTBEAT_PATH, http_app

    settings.SPEED_CHALLENGE = False
    settings.NODE_HEARTBEAT_RATE_PER_MINUTE = 3
    node_id, cred = enroll(client)
    body = json.dumps(
        {"state": "READY", "protocol_version": PROTOCOL_VERSION, "telemetry": {"jobs": []}}
    ).encode()

    async def post() -> tuple[int, dict[bytes, bytes], Any]:
        scope = {
            "type": "http",
            "method": "POST",
            "path": HEARTBEAT_PATH,
            "headers": [(b"authorization", f"Node {node_id}:{cred}".encode())],
        }
        app = ApplicationCommunicator(http_app, scope)
        await app.send_input({"type": "http.request", "body": body, "more_body": False})
        start = await app.receive_output(30)
        got = await app.receive_output(30)
        return start["status"], dict(start["headers"]), json.loads(got["body"])

    answers = [async_to_sync(post)() for _ in range(4)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 429], answers
    status, headers, payload = answers[-1]
    assert payload["error"]["code"] == "rate_limited"
    assert int(headers[b"retry-after"]) >= 1, headers
    assert all(b"retry-after" not in h for _, h, _ in answers[:3])
