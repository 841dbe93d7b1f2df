"""Reads for the node registry."""

from __future__ import annotations

import json
import shlex
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Count, QuerySet, Sum

from agent.protocol import HEARTBEATS_ZSET, heartbeat_key
from racon.ids import AccountId, DeploymentId, JobId, NodeId
from racon.redis import get_redis

from .models import EnrollmentToken, Event, Node
from .states import POOL

NODE_LIST_MAX = 5000  # nodes a list answers with, at most


def node_list(
    *, state: str | None = None, name: str | None = None, account_id: AccountId | None = None
) -> list[Node]:
    qs: QuerySet[Node] = Node.objects.all()
    if state:
        qs = qs.filter(state=state)
    if name:
        qs = qs.filter(name__icontains=name)
    if account_id is not None:
        qs = qs.filter(account_id=account_id)
    return list(qs[:NODE_LIST_MAX])


def node_events(*, node_id: NodeId, limit: int = 50) -> list[Event]:
    return list(Event.objects.filter(node_id=node_id)[:limit])


def event_list(
    *,
    kind: str | None = None,
    category: str | None = None,
    node_id: NodeId | None = None,
    job_id: JobId | None = None,
    deployment_id: DeploymentId | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
    account_id: AccountId | None = None,
) -> list[Event]:
    qs: QuerySet[Event] = Event.objects.all()
    if kind:
        qs = qs.filter(kind=kind)
    if category:
        qs = qs.filter(category=category)
    if node_id:
        qs = qs.filter(node_id=node_id)
    if job_id:
        qs = qs.filter(job_id=job_id)
    if deployment_id:
        qs = qs.filter(deployment_id=deployment_id)
    if since:
        qs = qs.filter(created_at__gte=since)
    if until:
        qs = qs.filter(created_at__lt=until)
    if account_id is not None:
        qs = qs.filter(node__account_id=account_id)
    return list(qs[:limit])


def heartbeat_ages(node_ids: list[str], *, now: datetime) -> dict[str, float | None]:
    """Seconds since each node's last heartbeat (one Redis round trip)."""
    if not node_ids:
        return {}
    scores = get_redis().zmscore(HEARTBEATS_ZSET, node_ids)
    ts = now.timestamp()
    return {
        nid: (round(max(0.0, ts - s), 3) if s is not None else None)
        for nid, s in zip(node_ids, scores, strict=True)
    }


def node_telemetry(*, node_id: NodeId) -> dict[str, Any]:
    raw = get_redis().hget(heartbeat_key(node_id), "telemetry")
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def token_status(token: EnrollmentToken, *, now: datetime) -> str:
    if token.revoked_at:
        return "revoked"
    if token.expires_at <= now:
        return "expired"
    if token.uses >= token.max_uses:
        return "used up"
    return "active"


def agent_command_line(*, token: str, node_name: str = "NODE_NAME") -> str:
    """The ready-to-copy command for a contributor's machine. The token travels in the
    environment (RACON_ENROLLMENT_TOKEN), never in argv, where every local user could read it
    (`ps`, /proc/<pid>/cmdline)."""
    return (
        f"RACON_ENROLLMENT_TOKEN={shlex.quote(token)} node-agent --foreground "
        f"--controller-url {shlex.quote(settings.CONTROLLER_PUBLIC_URL)} "
        f"--node-name {shlex.quote(node_name)}"
    )


def cluster_capacity(*, account_id: AccountId | None = None) -> dict[str, Any]:
    """Pooled CPU cores, RAM and VRAM over nodes that can take work, plus counts by state."""
    qs = Node.objects.all() if account_id is None else Node.objects.filter(account_id=account_id)
    by_state = {row["state"]: row["n"] for row in qs.values("state").annotate(n=Count("id"))}
    usable = qs.filter(state__in=POOL)
    agg = usable.aggregate(
        cores=Sum("cpu_logical_cores"),
        ram_total=Sum("ram_total"),
        ram_free=Sum("ram_available"),
        vram_total=Sum("vram_total"),
        vram_free=Sum("vram_free"),
    )
    return {"by_state": by_state, **{k: int(v or 0) for k, v in agg.items()}}
