"""Reliable command queue over Redis (the node's own list).

take():  BLMOVE queue → processing, atomically, so a command is never only in this process's memory.
ack():   after the controller accepted the command's report: remember the id as seen and LREM the
         item from processing, in one MULTI, so "reported" and "acknowledged" cannot drift apart.
recover(): on start, items left in processing (taken, not acknowledged: we crashed) go back to the
         head of the queue in their original order and are taken again.
Duplicates: an id already in the seen set (handled and reported before) is acknowledged and skipped.
A crash between the report being accepted and the ack leaves the item in processing with its id
not yet seen, so it runs again: delivery is at-least-once, and handlers are written for that.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from agent.protocol import (
    SEEN_TTL_SECONDS,
    node_processing_key,
    node_queue_key,
    node_seen_key,
)

log = logging.getLogger("agent.queue")


@dataclass
class QueueItem:
    raw: str  # the exact bytes in the processing list: LREM needs them
    command: dict[str, Any] | None  # None when malformed
    error: str | None = None  # why it is malformed
    accepted: bool = False  # passed the envelope's checks (agent/envelope.py) and ran here

    @property
    def id(self) -> str | None:
        if self.command is not None:
            return str(self.command["id"])
        try:  # a malformed command may still carry an id worth echoing back
            data = json.loads(self.raw)
            return str(data["id"]) if isinstance(data, dict) and data.get("id") else None
        except (ValueError, TypeError):
            return None

    @property
    def kind(self) -> str:
        return str(self.command["kind"]) if self.command else ""


def parse_command(raw: str) -> QueueItem:
    """Decode and shape-check one command; never raises."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return QueueItem(raw, None, f"malformed command: not JSON ({exc})")
    if not isinstance(data, dict):
        return QueueItem(raw, None, "malformed command: expected a JSON object")
    cid = data.get("id")
    if not isinstance(cid, str) or not cid:
        return QueueItem(raw, None, "malformed command: missing string field 'id'")
    kind = data.get("kind")
    if not isinstance(kind, str) or not kind:
        return QueueItem(raw, None, "malformed command: missing string field 'kind'")
    payload = data.get("payload", {})
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        return QueueItem(raw, None, "malformed command: 'payload' must be an object")
    data["payload"] = payload
    # An unknown kind is well-formed here; the Agent reports "unknown command" naming it.
    return QueueItem(raw, data, None)


class CommandQueue:
    def __init__(
        self,
        client: redis.Redis,
        node_id: str,
        *,
        seen_ttl: int = SEEN_TTL_SECONDS,
    ) -> None:
        self.r = client
        self.node_id = node_id
        self.queue_key = node_queue_key(node_id)
        self.processing_key = node_processing_key(node_id)
        self.seen_key = node_seen_key(node_id)
        self.seen_ttl = seen_ttl

    def recover(self) -> int:
        """Put every unacknowledged item back at the head of the queue, keeping order."""
        moved = 0
        # Newest-first from processing's tail onto the queue's head preserves the original order.
        while self.r.lmove(self.processing_key, self.queue_key, "RIGHT", "LEFT") is not None:
            moved += 1
        if moved:
            log.info("recovered %d unacknowledged command(s) from a previous run", moved)
        return moved

    def take(self, timeout: float = 1.0) -> QueueItem | None:
        """Block up to `timeout` for the next command (moved into processing), else None."""
        # Redis >= 6 takes fractional timeouts.
        raw = self.r.blmove(self.queue_key, self.processing_key, timeout, "LEFT", "RIGHT")
        if raw is None:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", errors="replace")
        # redis-py's return type is any response value; BLMOVE answers bytes or str.
        return parse_command(str(raw))

    def is_duplicate(self, command_id: str) -> bool:
        return self.r.zscore(self.seen_key, command_id) is not None

    def ack(self, item: QueueItem) -> None:
        """The command is done and its report accepted: forget it durably."""
        now = time.time()
        pipe = self.r.pipeline(transaction=True)
        cid = item.id
        if cid:
            pipe.zadd(self.seen_key, {cid: now})
            pipe.zremrangebyscore(self.seen_key, 0, now - self.seen_ttl)
            pipe.expire(self.seen_key, self.seen_ttl)
        pipe.lrem(self.processing_key, 1, item.raw)
        pipe.execute()

    def pending(self) -> int:
        return int(self.r.llen(self.queue_key))

    def in_processing(self) -> list[str]:
        return [
            v.decode() if isinstance(v, bytes) else v
            for v in self.r.lrange(self.processing_key, 0, -1)
        ]
