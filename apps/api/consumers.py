"""WebSocket consumers: a job's live token stream, and the dashboard's live node/deployment rows."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from agent.protocol import job_stream_key
from apps.api.ui_render import render_deployment_row, render_node_row
from apps.credits.ledger import account_for_user
from apps.jobs.models import Job
from apps.jobs.selectors import job_stream_node
from racon.redis import get_async_redis

log = logging.getLogger("racon.ws")


def _can_see_job(user: Any, job_id: str) -> bool:
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
        r = get_async_redis()
        node = await sync_to_async(job_stream_node)(self.job_id)
        key = job_stream_key(self.job_id, node or "")
        last = "0-0"
        idle = 0
        try:
            while idle < 120:
                got = await r.xread({key: last}, block=1000, count=256)
                if not got:
                    idle += 1
                    continue
                idle = 0
                for entry_id, fields in got[0][1]:
                    last = entry_id
                    await self.send(
                        text_data=json.dumps(
                            {
                                "type": fields.get("type"),
                                "seq": int(fields.get("seq", -1)),
                                "text": fields.get("text", ""),
                                "finish_reason": fields.get("finish_reason", ""),
                            }
                        )
                    )
                    if fields.get("type") in ("done", "error"):
                        await self.close()
                        return
            await self.close()
        except asyncio.CancelledError:
            pass


class DashboardConsumer(AsyncWebsocketConsumer):
    """ws/dashboard/: pushes re-rendered node rows (hx-swap-oob) when a node's state changes."""

    group = "nodes.dashboard"

    async def connect(self) -> None:
        user = self.scope.get("user")
        if not user or not user.is_authenticated:
            await self.close(code=4401)
            return
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def node_changed(self, event: dict[str, Any]) -> None:
        html = await sync_to_async(_render_node_row)(self.scope.get("user"), event["node_id"])
        if html:
            await self.send(text_data=html)

    async def deployment_changed(self, event: dict[str, Any]) -> None:
        html = await sync_to_async(_render_deployment_row)(
            self.scope.get("user"), event["deployment_id"]
        )
        if html:
            await self.send(text_data=html)


def _render_node_row(user: Any, node_id: str) -> str:
    return render_node_row(user=user, node_id=node_id)


def _render_deployment_row(user: Any, deployment_id: str) -> str:
    return render_deployment_row(user=user, deployment_id=deployment_id)
