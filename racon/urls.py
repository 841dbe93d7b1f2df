from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.api.health import health
from apps.nodes import api as nodes_api

agent_urls = [
    path("enroll", nodes_api.AgentEnrollApi.as_view(), name="agent-enroll"),
    path("heartbeat", nodes_api.agent_heartbeat, name="agent-heartbeat"),
    path("reports", nodes_api.AgentReportsApi.as_view(), name="agent-reports"),
]

admin_urls = [
    path("nodes", nodes_api.NodeListApi.as_view(), name="admin-nodes"),
    path("nodes/<uuid:node_id>", nodes_api.NodeDetailApi.as_view(), name="admin-node"),
    path("nodes/<uuid:node_id>/drain", nodes_api.NodeDrainApi.as_view(), name="admin-node-drain"),
    path("nodes/<uuid:node_id>/undrain", nodes_api.NodeUndrainApi.as_view(), name="admin-node-undrain"),
    path("nodes/<uuid:node_id>/revoke", nodes_api.NodeRevokeApi.as_view(), name="admin-node-revoke"),
    path("tokens", nodes_api.TokenListCreateApi.as_view(), name="admin-tokens"),
    path("tokens/<uuid:token_id>/revoke", nodes_api.TokenRevokeApi.as_view(), name="admin-token-revoke"),
    path("events", nodes_api.EventListApi.as_view(), name="admin-events"),
]

urlpatterns = [
    path("health", health, name="health"),
    path("api/agent/", include(agent_urls)),
    path("api/admin/", include(admin_urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("django-admin/", admin.site.urls),
]
