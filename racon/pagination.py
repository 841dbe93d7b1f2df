"""The admin and credits APIs' paging: limit/offset checked strictly, and a plain limited list.

DRF's LimitOffsetPagination quietly replaces a limit or offset it cannot read (``offset=null``,
``limit=-1``) with its default; these refuse it with 400 naming the parameter, in the API's error
format (apps/api/errors.py turns the ValidationError into ``{"error": {..., "fields"}}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import BasePagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response


def query_int(request: Request, name: str, *, minimum: int) -> int | None:
    """The query parameter NAME as an integer of at least MINIMUM; None when absent; 400 otherwise."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not (digits.isascii() and digits.isdigit()):
        raise ValidationError({name: [f"{name} must be an integer"]})
    value = int(text)
    if value < minimum:
        raise ValidationError({name: [f"{name} must be at least {minimum}"]})
    return value


def _int_parameter(name: str, *, minimum: int, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "required": False,
        "in": "query",
        "description": description,
        "schema": {"type": "integer", "minimum": minimum},
    }


class StrictLimitOffsetPagination(LimitOffsetPagination):
    """``{count, next, previous, results}`` pages; a limit of at least 1, an offset of at least 0."""

    def get_limit(self, request: Request) -> int | None:
        limit = query_int(request, self.limit_query_param, minimum=1)
        if limit is None:
            return self.default_limit
        return min(limit, self.max_limit) if self.max_limit else limit

    def get_offset(self, request: Request) -> int:
        return query_int(request, self.offset_query_param, minimum=0) or 0

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            _int_parameter(
                self.limit_query_param, minimum=1, description=str(self.limit_query_description)
            ),
            _int_parameter(
                self.offset_query_param, minimum=0, description=str(self.offset_query_description)
            ),
        ]


class LimitPagination(BasePagination):
    """``?limit=N``: the first N rows (default 100, at most 1000) as a plain list, without a page envelope."""

    default_limit = 100
    max_limit = 1000

    def paginate_queryset(
        self, queryset: QuerySet[Any, Any] | Sequence[Any], request: Request, view: Any = None
    ) -> list[Any]:
        limit = query_int(request, "limit", minimum=0)
        return list(queryset[: min(self.default_limit if limit is None else limit, self.max_limit)])

    def get_paginated_response(self, data: Any) -> Response:
        return Response(data)

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return schema

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            _int_parameter(
                "limit",
                minimum=0,
                description=f"at most this many, newest first (default {self.default_limit}, at most {self.max_limit})",
            )
        ]
