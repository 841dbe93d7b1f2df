"""Accounts and API-key routes; the project mounts them at the site root (full paths here)."""

from __future__ import annotations

from django.urls import path

from . import api

urlpatterns = [
    path("api/admin/accounts", api.AccountListCreateApi.as_view(), name="admin-accounts"),
    path(
        "api/admin/accounts/<uuid:account_id>/invite",
        api.AccountInviteApi.as_view(),
        name="admin-account-invite",
    ),
    path(
        "api/admin/accounts/<uuid:account_id>/limits",
        api.AccountLimitsApi.as_view(),
        name="admin-account-limits",
    ),
    path(
        "api/admin/keys/<uuid:key_id>/limits", api.KeyLimitsApi.as_view(), name="admin-key-limits"
    ),
    path("api/accounts/invite/accept", api.InviteAcceptApi.as_view(), name="account-invite-accept"),
    path("api/keys", api.KeyListCreateApi.as_view(), name="keys"),
    path("api/keys/<uuid:key_id>/revoke", api.KeyRevokeApi.as_view(), name="key-revoke"),
]
