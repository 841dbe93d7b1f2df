"""The client's address as this controller saw it, through the reverse proxies it trusts."""

from __future__ import annotations

from typing import Any

from django.conf import settings


def client_address(request: Any) -> str:
    """REMOTE_ADDR, or, when that is one of TRUSTED_PROXIES, the nearest X-Forwarded-For hop that
    is not itself a trusted proxy. A client cannot forge its way past a proxy it did not go through."""
    remote = str(request.META.get("REMOTE_ADDR", "") or "")
    trusted = set(settings.TRUSTED_PROXIES)
    if remote not in trusted:
        return remote
    hops = [
        h.strip() for h in str(request.META.get("HTTP_X_FORWARDED_FOR", "")).split(",") if h.strip()
    ]
    for hop in reversed(hops):
        if hop not in trusted:
            return hop
    return remote
