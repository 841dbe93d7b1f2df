"""GET /metrics (Prometheus text format): METRICS_TOKEN, a staff session or a staff API key."""

from __future__ import annotations

import hmac
import logging

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from .auth import bearer_from_header, principal_for_key
from .metrics import CONTENT_TYPE, metrics_render

log = logging.getLogger("racon.metrics")


def scrape_allowed(request: HttpRequest) -> bool | None:
    """True: allowed. False: authenticated but not staff (403). None: no valid credentials (401)."""
    raw = bearer_from_header(request.headers.get("Authorization", ""))
    if raw:
        token = settings.METRICS_TOKEN
        # An empty METRICS_TOKEN disables token scrapes; it never matches an empty bearer.
        if token and hmac.compare_digest(raw.encode(), token.encode()):
            return True
        principal = principal_for_key(raw)
        if principal is None:
            return None
        return bool(principal.is_staff)
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return bool(user.is_staff)
    return None


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    allowed = scrape_allowed(request)
    if allowed is None:
        resp = JsonResponse(
            {
                "error": {
                    "message": "metrics need 'Authorization: Bearer <METRICS_TOKEN>' or staff rights",
                    "code": "not_authenticated",
                }
            },
            status=401,
        )
        resp["WWW-Authenticate"] = 'Bearer realm="racon-metrics"'
        return resp
    if not allowed:
        return JsonResponse(
            {"error": {"message": "staff rights are required", "code": "permission_denied"}},
            status=403,
        )
    try:
        body = metrics_render()
    except Exception:  # the database or Redis is down: Prometheus records the failed scrape (up 0)
        log.exception("metrics scrape failed")
        return JsonResponse(
            {
                "error": {
                    "message": "metrics are unavailable: the database or Redis did not answer",
                    "code": "unavailable",
                }
            },
            status=503,
        )
    return HttpResponse(body, content_type=CONTENT_TYPE)
