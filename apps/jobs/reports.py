"""Accept an agent's report and hand it to the one service that owns it.

A node is untrusted (issue 28): its reports are counted per minute (NODE_REPORT_RATE_PER_MINUTE,
over → ReportRateLimited, 429), an event must be one of the kinds an agent sends (AGENT_EVENTS:
a node cannot write NODE_REVOKED or SPEED_VERIFIED into the log) with at most
AGENT_EVENT_DATA_MAX_BYTES of data, and a links report keeps only links to live nodes.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from django.conf import settings

from apps.models_repo.services import replicas_sync
from apps.nodes.commands import command_result_accept
from apps.nodes.enrollment import node_engines_update
from apps.nodes.errors import ReportRefused
from apps.nodes.events import event_record
from apps.nodes.lending import (
    PolicyError,
    node_lending_claim,
    node_lending_paused,
    node_lending_resumed,
)
from apps.nodes.links import link_record
from apps.nodes.models import EventCategory, Node
from apps.nodes.services import node_report_fault
from racon.ids import NodeId
from racon.redis import get_redis

from .deployments import (
    deployment_member_check,
    deployment_runtime_failed,
    deployments_lost_on_restart,
)
from .jobs import job_finish_from_report

# Every event kind an agent sends (agent/: outbox.event and the runtimes' on_event), and its
# category; any other name is refused. The controller's own kinds are never a node's to write.
AGENT_EVENTS = {
    "RPC_WORKER_STARTED": EventCategory.RUNTIME,
    "RPC_WORKER_FAILED": EventCategory.RUNTIME,
    "RPC_WORKER_STOPPED": EventCategory.RUNTIME,
    "RUNTIME_FAILED": EventCategory.RUNTIME,
    "PRIMARY_LOADED": EventCategory.RUNTIME,
    "PRIMARY_UNLOADED": EventCategory.RUNTIME,
    "PUBLIC_IP_VIOLATION": EventCategory.SECURITY,
    "MODEL_FETCH_PROGRESS": EventCategory.PLACEMENT,
    "MODEL_FETCHED": EventCategory.PLACEMENT,
    "MODEL_FETCH_FAILED": EventCategory.PLACEMENT,
    "COMMAND_REJECTED": EventCategory.RUNTIME,
    "AGENT_DRAINING": EventCategory.LIFECYCLE,
    "AGENT_STARTED": EventCategory.LIFECYCLE,
    "RPC_TUNNEL_REFUSED": EventCategory.SECURITY,
    "HARDWARE_UPDATED": EventCategory.MANAGEMENT,
    "METRICS_UNAVAILABLE": EventCategory.RUNTIME,
    "NODE_DRAINED": EventCategory.LIFECYCLE,  # the agent's own: "agent drained and stopping"
    "LENDING_POLICY": EventCategory.MANAGEMENT,
    "LENDING_POLICY_REFUSED": EventCategory.MANAGEMENT,
    "LENDING_PAUSED": EventCategory.MANAGEMENT,
    "LENDING_RESUMED": EventCategory.MANAGEMENT,
    "LENDING_HANDOFF": EventCategory.MANAGEMENT,
    "GPU_DEVICE_LEFT_OUT": EventCategory.RUNTIME,
}
_MAX_LINKS = 1024  # peers in one links report


class ReportRateLimited(Exception):
    """More than NODE_REPORT_RATE_PER_MINUTE reports from one node this minute (429); the report
    was not applied, and ``retry_after`` is the seconds until the window ends."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# A fixed one-minute window per node: count, and start the window's clock on its first report
# (or on a counter that lost its TTL). One script, so the count and its expiry never part.
_RATE_LUA = """
local n = redis.call('INCR', KEYS[1])
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], 60) end
return {n, redis.call('TTL', KEYS[1])}
"""


def _rate_check(node_id: NodeId) -> None:
    limit = int(settings.NODE_REPORT_RATE_PER_MINUTE)
    if limit <= 0:
        return
    count, ttl = get_redis().eval(_RATE_LUA, 1, f"racon:node:{node_id}:report-rate")
    if int(count) > limit:
        raise ReportRateLimited(
            f"more than NODE_REPORT_RATE_PER_MINUTE ({limit}) reports from this node within a "
            "minute",
            retry_after=max(1, int(ttl)),
        )


def report_accept(
    *, node_id: NodeId, report: dict[str, Any], now: datetime
) -> dict[str, Any] | None:
    """Apply one report exactly once (duplicates by report id are acknowledged and ignored);
    ReportRateLimited past the node's rate, before anything is read or written."""
    _rate_check(node_id)
    r = get_redis()
    if not r.set(f"racon:report:{report['id']}", 1, nx=True, ex=86400):
        return {"duplicate": True}
    kind = report["kind"]
    payload = report["payload"]
    try:
        return _dispatch(
            node_id=node_id,
            kind=kind,
            payload=payload,
            command_id=report.get("command_id"),
            now=now,
        )
    except Exception as exc:
        # Let the agent retry: forget that we saw this report id (a refusal is refused again).
        r.delete(f"racon:report:{report['id']}")
        if isinstance(exc, ReportRefused):
            _refusal_record(
                node_id=node_id,
                kind=kind,
                exc=exc,
                payload=payload,
                command_id=report.get("command_id"),
                now=now,
            )
        raise


REFUSAL_EVENT_WINDOW_SECONDS = 60


def _refusal_record(
    *,
    node_id: NodeId,
    kind: str,
    exc: Any,
    payload: dict[str, Any],
    command_id: str | None,
    now: datetime,
) -> None:
    """REPORT_REFUSED, at most one row per node, report kind and reason a minute (a hostile node
    could send thousands)."""
    if not get_redis().set(
        f"racon:report-refused:{node_id}:{kind}:{exc.code}",
        1,
        nx=True,
        ex=REFUSAL_EVENT_WINDOW_SECONDS,
    ):
        return
    event_record(
        kind="REPORT_REFUSED",
        category=EventCategory.SECURITY,
        now=now,
        node_id=node_id,
        message=f"{kind} refused: {exc}"[:500],
        data={
            "report_kind": kind,
            "code": exc.code,
            "command_id": command_id,
            "job_id": str(payload.get("job_id") or "")[:64] or None,
            "deployment_id": str((payload.get("data") or {}).get("deployment_id") or "")[:64]
            or None,
        },
    )


def _dispatch(
    *, node_id: NodeId, kind: str, payload: dict[str, Any], command_id: str | None, now: datetime
) -> dict[str, Any] | None:
    if kind == "event":
        name = str(payload.get("event", "")).upper()[:40]
        if not name:
            raise ValueError("event report needs payload.event")
        if name not in AGENT_EVENTS:
            raise ValueError(f"event {name!r} is not an event an agent sends")
        _data_check(payload.get("data"))
        if name == "MODEL_FETCH_PROGRESS":
            # Progress is frequent: keep the latest in Redis, not one row per step.
            get_redis().hset(
                f"racon:fetch:{node_id}",
                mapping={"data": json.dumps(payload.get("data") or {}), "at": now.timestamp()},
            )
            return None
        data = payload.get("data") or {}
        if not isinstance(data, dict):
            raise ValueError("event report needs payload.data as an object")
        loaded = (data.get("deployments") or []) if name == "AGENT_STARTED" else []
        if not isinstance(loaded, list):
            raise ValueError("AGENT_STARTED needs data.deployments as a list")
        dep_id = data.get("deployment_id")
        if dep_id and name == "RUNTIME_FAILED":
            # It fails the deployment: only a member of its plan may say so.
            deployment_member_check(deployment_id=dep_id, node_id=node_id)
        elif dep_id:
            try:
                deployment_member_check(deployment_id=dep_id, node_id=node_id)
            except (ValueError, ReportRefused):
                # A late report from a node dropped from a revised plan is honest: keep it on the
                # node, but never attach it to a deployment the node is not a member of.
                dep_id = None
        event_record(
            kind=name,
            category=AGENT_EVENTS[name],
            now=now,
            node_id=node_id,
            deployment_id=dep_id,
            message=str(payload.get("message", ""))[:500],
            data=data,
        )
        hardware = data.get("hardware")
        if name == "HARDWARE_UPDATED" and isinstance(hardware, dict) and "engines" in hardware:
            node_engines_update(node_id=node_id, engines=hardware["engines"], now=now)
        if name in ("HARDWARE_UPDATED", "LENDING_POLICY") and isinstance(data.get("lending"), dict):
            try:
                node_lending_claim(node_id=node_id, policy=data["lending"], now=now)
            except PolicyError as exc:
                raise ValueError(f"lending: {exc}") from None
        if name == "LENDING_PAUSED":
            node_lending_paused(
                node_id=node_id,
                handoff=str(data.get("handoff") or "failover"),
                reason=str(payload.get("message", "")),
                now=now,
            )
        if name == "LENDING_RESUMED":
            node_lending_resumed(node_id=node_id, now=now)
        if name == "AGENT_STARTED":
            failed = deployments_lost_on_restart(
                node_id=node_id, loaded=[str(d) for d in loaded], now=now
            )
            return {"deployments_failed": failed}
        if name == "RUNTIME_FAILED" and dep_id:
            deployment_runtime_failed(
                deployment_id=dep_id,
                node_id=node_id,
                message=str(payload.get("message", "runtime failed")),
                now=now,
            )
        return None
    if kind == "fault":
        node_report_fault(
            node_id=node_id,
            fatal=bool(payload.get("fatal")),
            message=str(payload.get("message", "")),
            now=now,
        )
        return None
    if kind == "models":
        files = payload.get("models")
        if not isinstance(files, list):
            raise ValueError("models report needs payload.models as a list")
        return {"matched": replicas_sync(node_id=node_id, files=files, now=now)}
    if kind == "links":
        links = payload.get("links")
        if not isinstance(links, list) or len(links) > _MAX_LINKS:
            raise ValueError(f"links report needs payload.links as a list of at most {_MAX_LINKS}")
        return {"stored": link_record(node_id=node_id, links=_to_live_nodes(links), now=now)}
    if kind == "job_finished":
        job_finish_from_report(node_id=node_id, payload=payload, now=now)
        return None
    if kind == "command_result":
        command_result_accept(node_id=node_id, command_id=command_id, payload=payload, now=now)
        return None
    raise ValueError(f"unknown report kind {kind!r}")


def _data_check(data: Any) -> None:
    cap = int(settings.AGENT_EVENT_DATA_MAX_BYTES)
    size = len(json.dumps(data or {}, default=str, separators=(",", ":")))
    if size > cap:
        raise ValueError(
            f"event data is {size} bytes as JSON, over AGENT_EVENT_DATA_MAX_BYTES ({cap})"
        )


def _to_live_nodes(links: list[Any]) -> list[Any]:
    """The links whose peer is an enrolled, unrevoked node (others are left out, as a failed probe
    is: a node may not name any string as its peer in racon:links)."""
    named: set[str] = set()
    for link in links:
        if isinstance(link, dict):
            try:
                named.add(str(uuid.UUID(str(link.get("node_id")))))
            except ValueError:
                continue
    live = {
        str(pk)
        for pk in Node.objects.filter(pk__in=named, revoked_at__isnull=True).values_list(
            "pk", flat=True
        )
    }
    return [
        link
        for link in links
        if not isinstance(link, dict) or "node_id" not in link or str(link["node_id"]) in live
    ]
