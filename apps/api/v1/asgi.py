"""The /v1 routes' Django handler: the project's middleware, without a thread hop per hook.

Django runs a ``MiddlewareMixin`` middleware's ``process_request``, ``process_view`` and
``process_response`` under an async view each through ``sync_to_async(thread_sensitive=True)``:
one hop to the process's single sync thread per hook, about a dozen per request with the
project's middleware. Every /v1 request of the process queues on that one thread for them,
before its prompt leaves (time to first token under concurrency) and after its answer (measured
in bench/relay.py as daphne's CPU per request, and in bench/concurrency.py as TTFT at 8 streams).

For /v1 those hooks do no I/O: the views are async, CSRF-exempt and authenticated by the
bearer key; sessions, ``request.user`` and messages are lazy and never touched (a session is
saved only when modified, SESSION_SAVE_EVERY_REQUEST is off). So this handler builds the same
chain from settings.MIDDLEWARE, with each such middleware's hooks called in the event loop.
racon/asgi.py sends /v1/ paths here, and the agent's reports (every job ends with one: a sync
DRF view, CSRF-exempt, the node's credential checked by the view itself, so the same holds; the
view itself still runs in one hop), and everything else to Django's own handler, so every other
route keeps Django's behaviour unchanged.

Nor does this handler open a ``ThreadSensitiveContext`` per request, as Django's does. Under one,
every thread-sensitive ``sync_to_async`` of the request (the request_started/finished signals,
the reports view, the /v1/models key check) runs on a thread made for that request, which opens
a database connection of its own and leaves it to the garbage collector: a new connection (on
PostgreSQL a new server process) for every agent report, so for every job. Without it, those
calls run on the process's one sync thread, as the agents' heartbeats already do
(racon/asgi.py), which keeps one connection. The request's heavy steps (admission, the stream,
the finish) run on the shared pool (apps/jobs/serving.pooled) either way.
"""

from __future__ import annotations

from typing import Any

from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler
from django.utils.deprecation import MiddlewareMixin

# /v1, and the agent's reports (one per job: its job_finished), a sync DRF view without
# authentication middleware of Django's (the node's credential is checked by the view).
PATH_PREFIXES = ("/v1/", "/api/agent/reports")


async def _acall(self: Any, request: Any) -> Any:
    """MiddlewareMixin.__acall__ with the hooks called in place."""
    response = None
    if hasattr(self, "process_request"):
        response = self.process_request(request)
    response = response or await self.get_response(request)
    if hasattr(self, "process_response"):
        response = self.process_response(request, response)
    return response


def inline(middleware: Any) -> Any:
    """A MiddlewareMixin subclass whose hooks run in the event loop (anything else unchanged)."""
    if not (isinstance(middleware, type) and issubclass(middleware, MiddlewareMixin)):
        return middleware
    namespace: dict[str, Any] = {"__acall__": _acall, "__module__": __name__}
    view_hook = getattr(middleware, "process_view", None)
    if view_hook is not None:

        async def process_view(self: Any, request: Any, view: Any, args: Any, kwargs: Any) -> Any:
            return view_hook(self, request, view, args, kwargs)

        namespace["process_view"] = process_view
    return type(f"Inline{middleware.__name__}", (middleware,), namespace)


class InlineMiddlewareHandler(ASGIHandler):
    """Django's ASGI handler with settings.MIDDLEWARE, each MiddlewareMixin made ``inline``, and
    no per-request ThreadSensitiveContext (the module's docstring says why)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler.load_middleware imports each entry of settings.MIDDLEWARE by name; the
        # import is wrapped for the time it builds the chain (at start-up, in one thread).
        original = getattr(base, "import_string")  # noqa: B009 (a module global, swapped below)
        setattr(base, "import_string", lambda path: inline(original(path)))  # noqa: B010 (a module global, swapped)
        try:
            super().load_middleware(is_async=is_async)
        finally:
            setattr(base, "import_string", original)  # noqa: B010 (restored)
