"""GET /metrics (Prometheus text format)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse


def metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse("", content_type="text/plain; version=0.0.4", status=503)
