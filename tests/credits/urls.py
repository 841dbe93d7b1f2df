"""The project's URLs plus the credits API at api/credits/ (until racon/urls.py mounts it)."""

from __future__ import annotations

from django.urls import include, path

from racon.urls import urlpatterns as project_urlpatterns

_mounted = any(str(getattr(p, "pattern", "")) == "api/credits/" for p in project_urlpatterns)
urlpatterns = list(project_urlpatterns)
if not _mounted:
    urlpatterns.append(path("api/credits/", include("apps.credits.urls")))
