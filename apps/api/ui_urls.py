"""Web UI routes (HTMX). Mounted at the site root by racon/urls.py."""

from __future__ import annotations

urlpatterns: list = []
