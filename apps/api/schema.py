"""drf-spectacular: RACoN's bearer-key authentication and its error responses in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import force_instance, is_serializer
from drf_spectacular.utils import Direction
from rest_framework import serializers

from racon.filters import StrictFilterSet


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "apps.api.auth.ApiKeyAuthentication"
    name = "BearerApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "AI_API_KEY or a per-account API key (scopes: inference, admin)",
        }


class ErrorSerializer(serializers.Serializer):
    """The admin and agent APIs' one error format: {"error": {"message", "code", "fields"?}}."""

    class ErrorBody(serializers.Serializer):
        message = serializers.CharField()
        code = serializers.CharField(required=False)
        fields = serializers.JSONField(required=False, help_text="per field: what is wrong with it")  # type: ignore[assignment]  # a declared field; the metaclass moves it off the class

    error = ErrorBody()


# Statuses any operation may answer besides its own, and why: a schema that leaves them out
# makes every refusal "undocumented" (the bounded schemathesis run checks each status it meets).
_ERROR_STATUSES = {
    "400": "invalid request: `error.fields` names each field and what is wrong with it",
    "401": "missing or invalid credentials",
    "403": "the credentials lack the rights (staff, or the admin scope)",
}
_PATH_ERROR_STATUSES = {"404": "no such object"}
_BODY_ERROR_STATUSES = {
    "409": "the request conflicts with what is stored (the message says what)",
    "413": "request body over the size limit",
}

# What DRF's CharField and django-filter's CharFilter refuse besides their lengths, as patterns: a
# NUL character (ProhibitNullCharactersValidator) and, where blanks are refused, a value that is
# only whitespace (trimmed to "" before the check). The schema says so, so that a client (or the
# schemathesis run) does not learn it from a 400.
# Python's whitespace (str.strip), spelled out: \s differs between ECMA and Python regexes.
_WHITESPACE = "".join(f"\\u{ord(c):04x}" for c in map(chr, range(0x3001)) if c.isspace())
NO_NUL_PATTERN = r"^[^\u0000]*$"
NOT_BLANK_PATTERN = rf"^[^\u0000]*[^\u0000{_WHITESPACE}][^\u0000]*$"


def _plain_string(schema: dict[str, Any]) -> bool:
    return (
        schema.get("type") == "string"
        and not {"pattern", "enum", "format", "anyOf", "oneOf", "$ref"} & schema.keys()
    )


class RaconAutoSchema(AutoSchema):
    """AutoSchema that documents the error responses every operation can give, in one format."""

    def _get_response_bodies(self, direction: Direction = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction=direction)
        extra = dict(_ERROR_STATUSES)
        if "{" in self.path:
            extra.update(_PATH_ERROR_STATUSES)
        if self.method in ("POST", "PUT", "PATCH"):
            extra.update(_BODY_ERROR_STATUSES)
            extra.setdefault("404", _PATH_ERROR_STATUSES["404"])
        for code, description in extra.items():
            if code not in responses:
                response = self._get_response_for_code(ErrorSerializer, code, direction=direction)
                response["description"] = description
                responses[code] = response
        return responses

    def _map_serializer_field(
        self, field: Any, direction: Direction, bypass_extensions: bool = False
    ) -> dict[str, Any]:
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if (
            direction == "request"
            and isinstance(field, serializers.CharField)
            and isinstance(schema, dict)
            and _plain_string(schema)
            # A RegexField's own pattern goes in after this (drf-spectacular's validators step).
            and not any(isinstance(v, RegexValidator) for v in field.validators)
        ):
            blank_refused = not field.allow_blank and field.trim_whitespace
            schema["pattern"] = NOT_BLANK_PATTERN if blank_refused else NO_NUL_PATTERN
        return schema

    def _get_request_for_media_type(
        self, serializer: Any, direction: Direction = "request"
    ) -> tuple[Any, bool]:
        schema, required = super()._get_request_for_media_type(serializer, direction)
        serializer = force_instance(serializer)
        if not required and is_serializer(serializer) and self.method != "PATCH":
            # No field is required alone, but a oneOf says which must be there (RegisterIn: path
            # or pypi): the body is required too.
            component = self.resolve_serializer(serializer, direction)
            schema_of = component.schema if component and component.schema else {}
            branches: list[dict[str, Any]] = schema_of.get("oneOf") or []
            required = bool(branches) and all(b.get("required") for b in branches)
        return schema, required

    def _get_filter_parameters(self) -> list[dict[str, Any]]:
        parameters = super()._get_filter_parameters()
        filterset = getattr(self.view, "filterset_class", None)
        if isinstance(filterset, type) and issubclass(filterset, StrictFilterSet):
            # StrictFilterSet refuses a parameter given with no value (or only whitespace).
            for parameter in parameters:
                schema = parameter.get("schema")
                if isinstance(schema, dict) and _plain_string(schema):
                    schema["pattern"] = NOT_BLANK_PATTERN
        return parameters
