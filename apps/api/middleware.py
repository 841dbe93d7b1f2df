from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse

from racon.http_limits import route_body_limit
from racon.logging import log_context

from .errors import openai_error


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
            response = await self.get_response(request)
        response["X-Request-Id"] = rid
        return response


def too_large_response(path: str, limit: int) -> JsonResponse:
    """413 in the error format of the API the path belongs to (OpenAI's under /v1)."""
    message = f"request body is larger than the limit of {limit} bytes"
    if path.startswith("/v1/"):
        return openai_error(message, status_code=413, code="request_too_large")
    return JsonResponse({"error": {"message": message, "code": "request_too_large"}}, status=413)


class BodyLimitMiddleware:
    """Bodies over DATA_UPLOAD_MAX_MEMORY_SIZE get 413 in the API's error format, before a view
    reads them (a declared Content-Length), or when reading them raises RequestDataTooBig."""

    async_capable = True
    sync_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    @staticmethod
    def _over(request: Any) -> int | None:
        # The upload routes (a KV transfer's saved slot, an agent bundle) have their own caps.
        default = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        limit = route_body_limit(request.path, default=-1 if default is None else default)
        if limit < 0:
            return None
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return None
        return limit if length > limit else None

    def __call__(self, request: Any) -> Any:
        if self.is_async:
            return self.__acall__(request)
        if (limit := self._over(request)) is not None:
            return too_large_response(request.path, limit)
        return self.get_response(request)

    async def __acall__(self, request: Any) -> Any:
        if (limit := self._over(request)) is not None:
            return too_large_response(request.path, limit)
        return await self.get_response(request)

    def process_exception(self, request: Any, exception: Exception) -> Any:
        if isinstance(exception, RequestDataTooBig):
            return too_large_response(request.path, settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0)
        return None


_ = Awaitable
