"""Template context every page gets: the insecure-LAN warning (docs/design/serving.md)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.http import HttpRequest

from racon.lan import is_loopback_host


def lan(request: HttpRequest) -> dict[str, Any]:
    """`insecure_lan`: RACON_INSECURE_LAN=1 on a controller whose URL is plain http on a network
    (the base template shows a warning banner)."""
    url = settings.CONTROLLER_PUBLIC_URL
    insecure = bool(
        settings.INSECURE_LAN
        and url.startswith("http://")
        and not is_loopback_host(urlsplit(url).hostname or "")
    )
    return {"insecure_lan": insecure}
