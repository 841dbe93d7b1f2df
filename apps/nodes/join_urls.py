"""Routes of the join line (apps/nodes/join.py), mounted at the site root by racon/urls.py."""

from __future__ import annotations

from django.urls import path, re_path

from . import api, bundles, join

TOKEN = r"(?P<token>rcn_[A-Za-z0-9_-]{1,200})"

urlpatterns = [
    path("join/files/<path:rel>", join.wheelhouse_file, name="join-file"),
    re_path(rf"^join/{TOKEN}\.py$", join.join_py, name="join-py"),
    re_path(rf"^join/{TOKEN}/manifest\.json$", join.join_manifest, name="join-manifest"),
    # The standalone agent (apps/nodes/bundles.py): the bundle for a machine, and the CA to keep.
    re_path(rf"^join/{TOKEN}/bundle\.txt$", bundles.join_bundle, name="join-bundle"),
    re_path(rf"^join/{TOKEN}/ca\.pem$", bundles.join_ca, name="join-ca"),
    re_path(rf"^join/{TOKEN}$", join.join_sh, name="join-sh"),
    # Read by the agent before it enrolls (agent/protocol.py PROTOCOL_PATH).
    path("api/agent/protocol", api.AgentProtocolApi.as_view(), name="agent-protocol"),
    path("api/agent/wheelhouse/manifest.json", join.upgrade_manifest, name="agent-wheelhouse"),
    path(
        "api/agent/wheelhouse/files/<path:rel>", join.wheelhouse_file, name="agent-wheelhouse-file"
    ),
    path("api/agent/bundle.txt", bundles.upgrade_bundle, name="agent-bundle"),
]
