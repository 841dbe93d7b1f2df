from __future__ import annotations

from django.urls import path

from .consumers import DashboardConsumer, JobStreamConsumer

websocket_urlpatterns = [
    path("ws/jobs/<uuid:job_id>/", JobStreamConsumer.as_asgi()),
    path("ws/dashboard/", DashboardConsumer.as_asgi()),
]
