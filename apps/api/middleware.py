from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

from racon.logging import log_context


class RequestIdMiddleware:
    """Give each request an id (or accept X-Request-Id), bind it to logs, echo it back."""

    async_capable = True
    sync_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def _rid(self, request: Any) -> str:
        rid = request.headers.get("X-Request-Id", "")[:64]
        return rid if rid and rid.replace("-", "").isalnum() else uuid.uuid4().hex

    def __call__(self, request: Any) -> Any:
        if self.is_async:
            return self.__acall__(request)
        rid = self._rid(request)
        request.request_id = rid
        with log_context(request_id=rid):
            response = self.get_response(request)
        response["X-Request-Id"] = rid
        return response

    async def __acall__(self, request: Any) -> Any:
        rid = self._rid(request)
        request.request_id = rid
        with log_context(request_id=rid):
            response = await self.get_response(request)  # type: ignore[misc]
        response["X-Request-Id"] = rid
        return response


_ = Awaitable
