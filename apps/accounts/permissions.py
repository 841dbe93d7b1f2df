from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission

from .principal import request_principal


class IsStaff(BasePermission):
    """Staff session, or an API key with the admin scope (or the operator's AI_API_KEY)."""

    message = "staff rights are required"

    def has_permission(self, request: Any, view: Any) -> bool:
        user = request.user
        return bool(
            user and getattr(user, "is_authenticated", False) and getattr(user, "is_staff", False)
        )


class IsAuthenticatedAccount(BasePermission):
    """Any signed-in user or valid API key; views then limit data to the caller's account."""

    def has_permission(self, request: Any, view: Any) -> bool:
        user = request.user
        return bool(user and getattr(user, "is_authenticated", False))


class KeyScope(BasePermission):
    """A bearer key needs the view's scope (``key_scopes``: method → scope, ``"*"`` the default);
    a signed-in session acts with the user's own rights, so it passes here."""

    message = "this API key lacks the scope this endpoint needs"

    def has_permission(self, request: Any, view: Any) -> bool:
        principal = request_principal(request)
        if principal is None:
            return True
        scopes: dict[str, str] = getattr(view, "key_scopes", {})
        scope = scopes.get(request.method, scopes.get("*"))
        if scope is None:
            return True
        if principal.has_scope(scope):
            return True
        self.message = f"this API key lacks the '{scope}' scope"
        return False
