"""Request body limits per route, shared by the server layer (racon/daphne_tls.py, before a body
is read) and the application (apps/api/middleware.BodyLimitMiddleware, in the API's error format).

Most routes take JSON of a few MiB at most; two take uploads: a KV state transfer's saved slot
(KV_TRANSFER_MAX_BYTES) and an agent bundle (HTTP_MAX_UPLOAD_BYTES).
"""

from __future__ import annotations

from django.conf import settings


def upload_routes() -> tuple[tuple[str, int], ...]:
    """(path prefix, limit in bytes) of the routes that take more than the default."""
    return (
        ("/api/agent/kv/", int(settings.KV_TRANSFER_MAX_BYTES)),
        ("/api/admin/bundles", int(settings.HTTP_MAX_UPLOAD_BYTES)),
    )


def route_body_limit(path: str, *, default: int) -> int:
    """The body limit of ``path`` (its query string ignored): an upload route's, else ``default``."""
    path = path.split("?", 1)[0]
    for prefix, limit in upload_routes():
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return limit
    return default
