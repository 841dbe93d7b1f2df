"""racon.urls plus the diagnostics endpoint, until the lead mounts it in racon/urls.py."""

from __future__ import annotations

from django.urls import path

from apps.api.diagnostics_api import NodeDiagnosticsApi
from racon.urls import urlpatterns as base

urlpatterns = [
    path(
        "api/admin/nodes/<uuid:node_id>/diagnostics",
        NodeDiagnosticsApi.as_view(),
        name="admin-node-diagnostics",
    ),
    *base,
]
