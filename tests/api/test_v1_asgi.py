"""racon.asgi sends /v1 and the agent's reports to their own Django handler (apps/api/v1/asgi.py):
the same middleware and the same answer as Django's handler, without a hop to the sync thread per
middleware hook."""

from __future__ import annotations

import gc
from typing import Any

import asgiref.sync
import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.db.backends.signals import connection_created

from racon.asgi import django_asgi, v1_asgi
from tests.factories import NodeFactory, funded_account, key_for

pytestmark = pytest.mark.django_db(transaction=True)


def _get(
    monkeypatch: pytest.MonkeyPatch, app: Any, path: str, auth: str, method: str = "GET"
) -> tuple[int, dict[bytes, bytes], bytes, int]:
    """(status, headers, body, sync-thread hops) of one request through ``app``."""
    hops = [0]
    original = asgiref.sync.SyncToAsync.__init__

    def counting(self: Any, func: Any, thread_sensitive: bool = True, **kw: Any) -> None:
        if thread_sensitive:
            hops[0] += 1
        original(self, func, thread_sensitive=thread_sensitive, **kw)

    async def run() -> tuple[int, dict[bytes, bytes], bytes]:
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "query_string": b"",
            "headers": [(b"host", b"127.0.0.1"), (b"authorization", auth.encode())],
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 5000),
        }
        comm = ApplicationCommunicator(app, scope)
        await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
        start = await comm.receive_output(30)
        body = await comm.receive_output(30)
        headers = {k.lower(): v for k, v in start["headers"]}
        return start["status"], headers, body["body"]

    with monkeypatch.context() as m:
        m.setattr(asgiref.sync.SyncToAsync, "__init__", counting)
        status, headers, body = async_to_sync(run)()
    return status, headers, body, hops[0]


def test_v1_gets_the_same_answer_and_headers_with_no_hop_per_middleware_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auth = key_for(funded_account(0))["HTTP_AUTHORIZATION"]
    django = _get(monkeypatch, django_asgi, "/v1/models", auth)
    inline = _get(monkeypatch, v1_asgi, "/v1/models", auth)
    assert django[0] == inline[0] == 200, (django, inline)
    assert django[2] == inline[2]
    # The security middleware's headers, the request id: the whole chain ran.
    skip = {b"x-request-id", b"content-length"}
    assert {k: v for k, v in django[1].items() if k not in skip} == {
        k: v for k, v in inline[1].items() if k not in skip
    }
    for header in (b"x-frame-options", b"x-content-type-options", b"x-request-id"):
        assert header in inline[1], inline[1]
    # Django's handler hops to the sync thread for each hook of each MiddlewareMixin; the /v1
    # handler only for the request signals (started, finished) and the view's own two
    # synchronous steps (the key, the models).
    assert inline[3] <= 4 < django[3], (inline[3], django[3])


def test_the_agents_reports_get_the_same_answer_with_one_hop_for_the_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    django = _get(monkeypatch, django_asgi, "/api/agent/reports", "Node x:y", method="POST")
    inline = _get(monkeypatch, v1_asgi, "/api/agent/reports", "Node x:y", method="POST")
    assert django[0] == inline[0] == 401, (django, inline)
    assert django[2] == inline[2]
    assert b"x-frame-options" in inline[1] and b"x-request-id" in inline[1]
    # The request signals, the (synchronous) view itself and its response's close.
    assert inline[3] <= 4 < django[3], (inline[3], django[3])


def test_the_agents_reports_reuse_one_database_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under Django's handler each report's view runs on a thread made for that request, which
    opens a database connection of its own (on PostgreSQL, a new server process per job's
    report); the reports' handler keeps to the process's sync thread and its one connection."""
    node = NodeFactory()
    made: list[str] = []

    def created(sender: Any, connection: Any, **kw: Any) -> None:
        made.append(connection.alias)

    connection_created.connect(created)
    try:
        counts = []
        for app in (django_asgi, v1_asgi):
            made.clear()
            for _ in range(3):
                status, *_ = _get(
                    monkeypatch, app, "/api/agent/reports", f"Node {node.pk}:cred", method="POST"
                )
                assert status == 400  # the node is known (its row read), the empty body refused
            counts.append(len(made))
    finally:
        connection_created.disconnect(created)
        gc.collect()  # the connections Django's handler left in its requests' threads
    assert counts[1] == 0 < counts[0], counts
