"""GET /api/admin/nodes/<id>/diagnostics: the node's diagnostics bundle as a tar.gz download (staff)."""

from __future__ import annotations

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.views import APIView

from apps.jobs.diagnostics import UnknownNode, node_diagnostics
from racon.ids import NodeId


class NodeDiagnosticsApi(APIView):
    """Versions, state history, events, hardware, last errors, recent jobs and reachability; no secrets."""

    @extend_schema(
        responses={
            (200, "application/gzip"): OpenApiResponse(
                OpenApiTypes.BINARY, description="tar.gz bundle"
            )
        },
    )
    def get(self, request: Request, node_id: NodeId) -> HttpResponse:
        now = timezone.now()
        try:
            diag = node_diagnostics(node_id=node_id, now=now)
        except UnknownNode as exc:
            raise NotFound(str(exc)) from None
        resp = HttpResponse(diag.data, content_type="application/gzip")
        resp["Content-Disposition"] = (
            f'attachment; filename="racon-diagnose-{diag.node_id}-{now.strftime("%Y%m%dT%H%M%SZ")}.tar.gz"'
        )
        resp["Cache-Control"] = "no-store"
        return resp
