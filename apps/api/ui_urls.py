"""Web UI routes (HTMX). Mounted at the site root by racon/urls.py."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path, re_path

from . import ui_accounts, ui_lending
from . import ui_views as v
from .login import ThrottledLoginView

urlpatterns = [
    path("login/", ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", v.dashboard, name="ui-dashboard"),
    path("nodes/", v.node_list, name="ui-nodes"),
    path("nodes/links/", v.node_links, name="ui-node-links"),
    path("nodes/<uuid:node_id>/", v.node_detail, name="ui-node"),
    path("nodes/<uuid:node_id>/drain", v.node_drain, name="ui-node-drain"),
    path("nodes/<uuid:node_id>/undrain", v.node_undrain, name="ui-node-undrain"),
    path("nodes/<uuid:node_id>/lending", ui_lending.node_lending, name="ui-node-lending"),
    path("tokens/", v.token_list, name="ui-tokens"),
    path("tokens/<uuid:token_id>/revoke", v.token_revoke, name="ui-token-revoke"),
    path("models/", v.model_list, name="ui-models"),
    path("deployments/", v.deployment_list, name="ui-deployments"),
    path("deployments/preview", v.deployment_preview, name="ui-deployment-preview"),
    path("deployments/<uuid:deployment_id>/stop", v.deployment_stop, name="ui-deployment-stop"),
    path("events/", v.events_page, name="ui-events"),
    path("jobs/", v.job_list, name="ui-jobs"),
    path("jobs/<uuid:job_id>/", v.job_detail, name="ui-job"),
    path("jobs/<uuid:job_id>/cancel", v.job_cancel, name="ui-job-cancel"),
    path("credits/", v.credits_page, name="ui-credits"),
    path("credits/receipts/verify", v.receipt_verify, name="ui-receipt-verify"),
    path("credits/earnings/", ui_lending.earnings_page, name="ui-earnings"),
    path("keys/", ui_accounts.key_list, name="ui-keys"),
    path("keys/<uuid:key_id>/revoke", ui_accounts.key_revoke, name="ui-key-revoke"),
    path("accounts/", ui_accounts.account_list, name="ui-accounts"),
    path("invite/<str:uidb64>/<str:token>/", ui_accounts.invite, name="ui-invite"),
    path("playground/", v.playground, name="ui-playground"),
    path("playground/chat/completions", v.playground_chat, name="ui-playground-chat"),
    re_path(r"^static/(?P<path>.+)$", v.static, name="ui-static"),
]
