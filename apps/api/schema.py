"""drf-spectacular: describe RACoN's bearer-key authentication in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "apps.api.auth.ApiKeyAuthentication"
    name = "BearerApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {"type": "http", "scheme": "bearer", "description": "AI_API_KEY or a per-account API key (scopes: inference, admin)"}
