"""WebSocket consumers: a job's live token stream, and the dashboard's live rows and charts.

A slow Redis never ends a socket with a traceback: a timeout or a dropped connection is retried
(``_retrying``) and logged as one line; the channel layer's own receive does the same
(``apps/api/channel_layer.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.http import Http404
from django.utils import timezone
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from apps.api.ui_charts import ChartRefused, chart_payload
from apps.api.ui_render import render_deployment_row, render_node_row, viewer_for
from apps.credits.ledger import account_for_user
from apps.jobs.models import Job
from apps.jobs.streams import job_watch
from racon.ids import DeploymentId, JobId, NodeId

log = logging.getLogger("racon.ws")

RETRY_DELAYS = (0.2, 0.5, 1.0)
MAX_CHARTS = 24  # per socket: a page shows a handful


async def _retrying[T](what: str, call: Callable[[], Awaitable[T]]) -> T | None:
    """``call()``, retried on a Redis timeout or dropped connection; after the last try one line is
    logged and None returned (the socket stays open: the next update tries again)."""
    for attempt, delay in enumerate((*RETRY_DELAYS, None), start=1):
        try:
            return await call()
        except (RedisTimeoutError, RedisConnectionError) as exc:
            if delay is None:
                log.warning(
                    "%s: Redis did not answer after %d tries (%s); skipped", what, attempt, exc
                )
                return None
            await asyncio.sleep(delay)
    return None


def _can_see_job(user: Any, job_id: JobId) -> bool:
    if not user or not user.is_authenticated:
        return False
    job = Job.objects.filter(pk=job_id).values("account_id").first()
    if job is None:
        return False
    return bool(user.is_staff) or job["account_id"] == account_for_user(user=user).id


class JobStreamConsumer(AsyncWebsocketConsumer):
    """ws/jobs/<id>/: replays the job's stream from the start, then follows it until it ends."""

    async def connect(self) -> None:
        self.job_id = self.scope["url_route"]["kwargs"]["job_id"]
        if not await sync_to_async(_can_see_job)(self.scope.get("user"), self.job_id):
            await self.close(code=4403)
            return
        await self.accept()
        self.task = asyncio.create_task(self._follow())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "task", None)
        if task is not None:
            task.cancel()

    async def _follow(self) -> None:
        # The same follower as /v1's (apps/jobs/streams.job_watch): the page follows a failover
        # to the job's next attempt, and sees the tokens its client was sent, each once.
        try:
            async for fields in job_watch(self.job_id):
                await self.send(
                    text_data=json.dumps(
                        {
                            "type": fields.get("type"),
                            "seq": int(fields.get("seq") or -1),
                            "text": fields.get("text", ""),
                            "finish_reason": fields.get("finish_reason", ""),
                        }
                    )
                )
            await self.close()
        except asyncio.CancelledError:
            pass


class DashboardConsumer(AsyncWebsocketConsumer):
    """ws/dashboard/: pushes re-rendered node and deployment rows (hx-swap-oob) when one changes,
    and the page's charts (JSON ``{"type": "charts", "charts": {id: payload}}``) when it asks for
    them (``{"charts": {id: spec}}``) and again each time the rollup is written."""

    group = "nodes.dashboard"
    charts: dict[str, dict[str, Any]]

    async def connect(self) -> None:
        user = self.scope.get("user")
        if not user or not user.is_authenticated:
            await self.close(code=4401)
            return
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            msg = json.loads(text_data or "")
        except ValueError:
            return
        specs = msg.get("charts") if isinstance(msg, dict) else None
        if not isinstance(specs, dict):
            return
        self.charts = {
            str(k): v for k, v in list(specs.items())[:MAX_CHARTS] if isinstance(v, dict)
        }
        await self._send_charts()

    async def rollup_written(self, event: dict[str, Any]) -> None:
        if getattr(self, "charts", None):
            await self._send_charts()

    async def _send_charts(self) -> None:
        user = self.scope.get("user")
        charts = dict(self.charts)
        payloads = await _retrying(
            "dashboard charts", lambda: sync_to_async(_chart_payloads)(user, charts)
        )
        if payloads:
            await self.send(text_data=json.dumps({"type": "charts", "charts": payloads}))

    async def node_changed(self, event: dict[str, Any]) -> None:
        user = self.scope.get("user")
        html = await _retrying(
            f"node {event['node_id']} row",
            lambda: sync_to_async(_render_node_row)(user, event["node_id"]),
        )
        if html:
            await self.send(text_data=html)

    async def deployment_changed(self, event: dict[str, Any]) -> None:
        user = self.scope.get("user")
        html = await _retrying(
            f"deployment {event['deployment_id']} row",
            lambda: sync_to_async(_render_deployment_row)(user, event["deployment_id"]),
        )
        if html:
            await self.send(text_data=html)


def _chart_payloads(user: Any, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each chart the page asked for, re-checked for this user; a refused spec is left out."""
    if not user or not user.is_authenticated:
        return {}
    viewer = viewer_for(user)
    now = timezone.now()
    out: dict[str, Any] = {}
    for chart_id, spec in specs.items():
        try:
            out[chart_id] = chart_payload(viewer=viewer, spec=dict(spec), now=now)
        except (ChartRefused, Http404, ValueError, TypeError) as exc:
            log.info("chart %s refused for %s: %s", chart_id, user, exc)
    return out


def _render_node_row(user: Any, node_id: NodeId) -> str:
    return render_node_row(user=user, node_id=node_id)


def _render_deployment_row(user: Any, deployment_id: DeploymentId) -> str:
    return render_deployment_row(user=user, deployment_id=deployment_id)
