"""drf-spectacular: RACoN's bearer-key authentication and its error responses in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import Direction
from rest_framework import serializers


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
