"""The event log writer: one function, used by every app."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from .models import Event

log = logging.getLogger("racon.events")


def event_record(
    *,
    kind: str,
    category: str,
    now: datetime,
    node_id: Any = None,
    job_id: Any = None,
    deployment_id: Any = None,
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
