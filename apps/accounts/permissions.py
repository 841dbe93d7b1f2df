from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission


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
