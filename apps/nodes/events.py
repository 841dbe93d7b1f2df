"""The event log writer: one function, used by every app."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings

from racon.ids import DeploymentId, JobId, NodeId

from .models import Event

log = logging.getLogger("racon.events")


def event_record(
    *,
    kind: str,
    category: str,
    now: datetime,
    node_id: NodeId | None = None,
    job_id: JobId | None = None,
    deployment_id: DeploymentId | None = None,
    old_state: str = "",
    new_state: str = "",
    message: str = "",
    data: dict[str, Any] | None = None,
) -> Event:
    """Append one event row (call inside the transaction that made the change)."""
    event = Event.objects.create(
        kind=kind,
        category=category,
        node_id=node_id,
        job_id=job_id,
        deployment_id=deployment_id,
        old_state=old_state,
        new_state=new_state,
        message=message[:500],
        data=data or {},
        created_at=now,
    )
    log.info(
        "%s %s",
        kind,
        message,
        extra={
            k: str(v)
            for k, v in {
                "node_id": node_id,
                "job_id": job_id,
                "deployment_id": deployment_id,
            }.items()
            if v is not None
        },
    )
    return event


def events_prune(*, now: datetime, batch: int = 5000) -> int:
    """Delete event rows older than EVENT_RETENTION_DAYS, in batches (a short lock each); returns
    how many went. The retention is at least the web UI's longest chart (README, Settings)."""
    cutoff = now - timedelta(days=float(settings.EVENT_RETENTION_DAYS))
    gone = 0
    while True:
        ids = list(Event.objects.filter(created_at__lt=cutoff).values_list("pk", flat=True)[:batch])
        if not ids:
            return gone
        gone += Event.objects.filter(pk__in=ids).delete()[0]
