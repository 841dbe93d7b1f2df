"""ASGI entry point: Django over HTTP, Channels consumers over WebSocket (served by daphne).

Agent heartbeats are the hottest path (thousands of nodes every few seconds) and need neither
sessions, CSRF, auth middleware nor templates: they are answered here, before Django's request
machinery, by the same function the Django view calls.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "racon.settings")

from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from apps.api.routing import websocket_urlpatterns  # noqa: E402
from apps.api.v1.asgi import PATH_PREFIXES as INLINE_PREFIXES  # noqa: E402
from apps.api.v1.asgi import InlineMiddlewareHandler  # noqa: E402
from apps.nodes.api import heartbeat_handle, heartbeat_headers  # noqa: E402

HEARTBEAT_PATH = "/api/agent/heartbeat"
# /v1 and the agent's reports: the same Django middleware without a thread hop per hook
# (apps/api/v1/asgi.py).
v1_asgi = InlineMiddlewareHandler()


async def _read_body(receive: Any, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        size += len(body)
        if size <= limit + 1:
            chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path = scope.get("path") or ""
    if path.startswith(INLINE_PREFIXES):
        await v1_asgi(scope, receive, send)
        return
    if path != HEARTBEAT_PATH:
        await django_asgi(scope, receive, send)
        return
    auth = ""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            auth = value.decode("latin-1")
            break
    body = await _read_body(receive, settings.MAX_AGENT_BODY_BYTES)
    if body is None:
        return
    status, payload = await heartbeat_handle(
        method=scope.get("method", ""), authorization=auth, body=body
    )
    data = json.dumps(payload, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(
                    (k.lower().encode(), v.encode())
                    for k, v in heartbeat_headers(status, payload).items()
                ),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


# Everything imported so far lives as long as the process: move it out of the garbage
# collector's generations so collections stay short under load (fewer latency spikes).
gc.collect()
gc.freeze()

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
