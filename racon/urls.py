from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.api import agent_self
from apps.api.diagnostics_api import NodeDiagnosticsApi
from apps.api.health import health
from apps.api.login import admin_login_throttled
from apps.api.metrics_view import metrics
from apps.api.v1 import views as v1
from apps.jobs import api as jobs_api
from apps.jobs import kvtransfer_api
from apps.models_repo import api as models_api
from apps.nodes import api as nodes_api
from apps.nodes import bundles as nodes_bundles
from apps.nodes import gpu_challenge_api

agent_urls = [
    path("enroll", nodes_api.AgentEnrollApi.as_view(), name="agent-enroll"),
    path("heartbeat", nodes_api.agent_heartbeat, name="agent-heartbeat"),
    path("redis", nodes_api.AgentRedisApi.as_view(), name="agent-redis"),
    path("reports", jobs_api.AgentReportsApi.as_view(), name="agent-reports"),
    path("models/<str:sha256>", models_api.model_file_download, name="agent-model-file"),
    path("kv/<str:transfer_id>", kvtransfer_api.kv_blob, name="agent-kv-blob"),
    # The node's own view of itself (the desktop app, issue 31): apps/api/agent_self.py.
    path("self", agent_self.AgentSelfApi.as_view(), name="agent-self"),
    path("earnings", agent_self.AgentEarningsApi.as_view(), name="agent-earnings"),
    path("lending", agent_self.AgentLendingApi.as_view(), name="agent-lending"),
]

admin_urls = [
    path("nodes", nodes_api.NodeListApi.as_view(), name="admin-nodes"),
    path("nodes/links", nodes_api.NodeLinksApi.as_view(), name="admin-node-links"),
    path("nodes/<uuid:node_id>", nodes_api.NodeDetailApi.as_view(), name="admin-node"),
    path("nodes/<uuid:node_id>/drain", nodes_api.NodeDrainApi.as_view(), name="admin-node-drain"),
    path(
        "nodes/<uuid:node_id>/undrain",
        nodes_api.NodeUndrainApi.as_view(),
        name="admin-node-undrain",
    ),
    path(
        "nodes/<uuid:node_id>/revoke", nodes_api.NodeRevokeApi.as_view(), name="admin-node-revoke"
    ),
    path(
        "nodes/<uuid:node_id>/allow-reenroll",
        nodes_api.NodeAllowReenrollApi.as_view(),
        name="admin-node-allow-reenroll",
    ),
    path(
        "nodes/<uuid:node_id>/gpu-challenge",
        gpu_challenge_api.NodeGpuChallengeApi.as_view(),
        name="admin-node-gpu-challenge",
    ),
    path(
        "nodes/<uuid:node_id>/gpu-challenge/clear",
        gpu_challenge_api.NodeGpuChallengeClearApi.as_view(),
        name="admin-node-gpu-challenge-clear",
    ),
    path(
        "nodes/<uuid:node_id>/diagnostics",
        NodeDiagnosticsApi.as_view(),
        name="admin-node-diagnostics",
    ),
    path("tokens", nodes_api.TokenListCreateApi.as_view(), name="admin-tokens"),
    path(
        "tokens/<uuid:token_id>/revoke",
        nodes_api.TokenRevokeApi.as_view(),
        name="admin-token-revoke",
    ),
    path("events", nodes_api.EventListApi.as_view(), name="admin-events"),
    path("bundles", nodes_bundles.BundleApi.as_view(), name="admin-bundles"),
    path("models", models_api.ModelListCreateApi.as_view(), name="admin-models"),
    path("models/<str:name>", models_api.ModelDetailApi.as_view(), name="admin-model"),
    path("deployments", jobs_api.DeploymentListCreateApi.as_view(), name="admin-deployments"),
    path(
        "deployments/preview",
        jobs_api.DeploymentPreviewApi.as_view(),
        name="admin-deployment-preview",
    ),
    path(
        "deployments/<uuid:deployment_id>",
        jobs_api.DeploymentDetailApi.as_view(),
        name="admin-deployment",
    ),
    path(
        "deployments/<uuid:deployment_id>/stop",
        jobs_api.DeploymentStopApi.as_view(),
        name="admin-deployment-stop",
    ),
    path("jobs", jobs_api.JobListApi.as_view(), name="admin-jobs"),
    path("jobs/<uuid:job_id>", jobs_api.JobDetailApi.as_view(), name="admin-job"),
    path("jobs/<uuid:job_id>/cancel", jobs_api.JobCancelApi.as_view(), name="admin-job-cancel"),
]

v1_urls = [
    path("chat/completions", v1.chat_completions, name="v1-chat"),
    path("completions", v1.completions, name="v1-completions"),
    path("embeddings", v1.embeddings, name="v1-embeddings"),
    path("models", v1.models_list, name="v1-models"),
    path("models/<path:model_id>", v1.model_detail, name="v1-model"),
]

urlpatterns = [
    path("health", health, name="health"),
    path("metrics", metrics, name="metrics"),
    path("", include("apps.nodes.join_urls")),  # /join/<token>: the one-line join
    path("api/agent/", include(agent_urls)),
    path("api/admin/", include(admin_urls)),
    path("v1/", include(v1_urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    # The admin's sign-in is throttled like /login/ (issue 28); this route comes first.
    path("django-admin/login/", admin_login_throttled(admin.site.login), name="admin-login"),
    path("django-admin/", admin.site.urls),
    path("api/credits/", include("apps.credits.urls")),
    path("", include("apps.accounts.urls")),
    path("", include("apps.api.ui_urls")),
]
