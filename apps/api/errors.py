"""One error format for the admin API and one (OpenAI's) for /v1."""

from __future__ import annotations

from typing import Any

from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Admin API errors: {"error": {"message", "code", "fields"?}} with the right status."""
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "not found")
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    body: dict[str, Any] = {"message": "", "code": getattr(exc, "default_code", "error")}
    if isinstance(exc, exceptions.ValidationError):
        body["message"] = "invalid request"
        body["fields"] = response.data
        body["code"] = "invalid"
    else:
        detail = response.data.get("detail") if isinstance(response.data, dict) else response.data
        body["message"] = str(detail)
        code = getattr(detail, "code", None)
        if code:
            body["code"] = code
    response.data = {"error": body}
    return response


def openai_error(
    message: str,
    *,
    status_code: int,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JsonResponse:
    """OpenAI's exact error body: {"error": {"message", "type", "param", "code"}}."""
    resp = JsonResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status=status_code,
    )
    for k, v in (headers or {}).items():
        resp[k] = v
    return resp


class ApiError(Exception):
    """An error the /v1 views turn into OpenAI's format."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = status.HTTP_400_BAD_REQUEST,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> JsonResponse:
        return openai_error(
            self.message,
            status_code=self.status_code,
            type_=self.type,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )
