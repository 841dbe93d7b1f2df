"""GET /health: database, Redis and Celery (200 when all answer, else 503)."""

from __future__ import annotations

import time
from typing import Any

from django.db import connection
from django.http import HttpRequest, JsonResponse

import racon
from racon.redis import get_redis

CELERY_ALIVE_KEY = "racon:celery:alive"


def service_health() -> dict[str, Any]:
    """Probe each dependency; never raises."""
    checks: dict[str, Any] = {}
    t = time.perf_counter()
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
        checks["database"] = {
            "ok": True,
            "vendor": connection.vendor,
            "ms": round((time.perf_counter() - t) * 1000, 2),
        }
    except Exception as exc:
        checks["database"] = {"ok": False, "error": str(exc)[:200]}
    t = time.perf_counter()
    try:
        r = get_redis()
        r.ping()
        checks["redis"] = {"ok": True, "ms": round((time.perf_counter() - t) * 1000, 2)}
        # Celery workers refresh this key from a heartbeat signal (racon/celery_signals.py).
        age = r.get(CELERY_ALIVE_KEY)
        alive = age is not None and time.time() - float(age) < 60
        checks["celery"] = {
            "ok": alive,
            "last_seen_s": None if age is None else round(time.time() - float(age), 1),
        }
        if not alive:
            checks["celery"]["error"] = "no Celery worker seen in the last 60 s"
    except Exception as exc:
        checks["redis"] = {"ok": False, "error": str(exc)[:200]}
        checks["celery"] = {"ok": False, "error": "unknown: Redis is unreachable"}
    ok = all(c.get("ok") for c in checks.values())
    return {"status": "ok" if ok else "unavailable", "version": racon.__version__, "checks": checks}


def health(request: HttpRequest) -> JsonResponse:
    body = service_health()
    return JsonResponse(body, status=200 if body["status"] == "ok" else 503)
