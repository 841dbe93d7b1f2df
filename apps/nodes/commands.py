"""The command bus to agents: a command onto the node's own Redis queue, its result back to
whoever waits for it, and the job cancel flag the primary's runtime polls. The one writer of
``racon:n:{node}:commands``, ``racon:cmd:{id}:node``, ``racon:cmdresult:{id}`` and
``racon:n:{node}:job:{job}:cancel``.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from agent.protocol import job_cancel_key, new_id, node_queue_key
from racon.redis import get_redis, get_redis_blocking

from .errors import ReportRefused
from .events import event_record
from .models import EventCategory

# How long a cancel flag outlives the job it stops: longer than any stream.
CANCEL_FLAG_TTL_SECONDS = 3600


def job_cancel_flag(*, job_id: Any, node_id: Any) -> None:
    """Ask the job's runtime on ``node_id`` to stop: it polls this flag between tokens."""
    get_redis().set(job_cancel_key(str(job_id), str(node_id)), 1, ex=CANCEL_FLAG_TTL_SECONDS)


def job_cancel_clear(*, job_id: Any, node_id: Any) -> None:
    """Lift a cancel flag (a job handed back to the same primary after a failover)."""
    get_redis().delete(job_cancel_key(str(job_id), str(node_id)))


def _result_key(command_id: str) -> str:
    return f"racon:cmdresult:{command_id}"


def _command_node_key(command_id: str) -> str:
    return f"racon:cmd:{command_id}:node"


# Longer than the longest command_wait (a model transfer, MODEL_FETCH_TIMEOUT 1800 s), so a slow
# but honest result still finds whom its command was sent to.
COMMAND_NODE_TTL_SECONDS = 2 * 3600


def command_send(*, node_id: Any, kind: str, payload: dict[str, Any]) -> str:
    """Append a command to the node's own queue and remember which node it went to.

    The two writes are one MULTI: a result can never arrive for a command whose node is unknown.
    """
    command_id = new_id()
    body = {"id": command_id, "kind": kind, "payload": payload, "issued_at": time.time()}
    with get_redis().pipeline(transaction=True) as pipe:
        pipe.set(_command_node_key(command_id), str(node_id), ex=COMMAND_NODE_TTL_SECONDS)
        pipe.rpush(node_queue_key(str(node_id)), json.dumps(body, separators=(",", ":")))
        pipe.execute()
    return command_id


def command_wait(*, command_id: str, timeout: float) -> dict[str, Any] | None:
    """Block until the agent's command_result for this command arrives, or None on timeout."""
    got = get_redis_blocking().blpop([_result_key(command_id)], timeout=max(1, int(timeout)))
    if got is None:
        return None
    return json.loads(got[1])


def command_result_accept(
    *, node_id: Any, command_id: str | None, payload: dict[str, Any], now: datetime
) -> None:
    """Hand a command's result to whoever waits for it (placement), kept briefly for late readers."""
    if not command_id:
        raise ValueError("command_result needs command_id")
    r = get_redis()
    sent_to = r.get(_command_node_key(command_id))
    if sent_to is None:
        raise ReportRefused(
            f"command_result refused: command {command_id} was never sent, "
            f"or its result is over {COMMAND_NODE_TTL_SECONDS}s late",
            code="unknown_command",
        )
    if sent_to != str(node_id):
        raise ReportRefused(
            f"command_result refused: command {command_id} was sent to another node, not to node {node_id}",
            code="not_command_node",
        )
    key = _result_key(command_id)
    with r.pipeline(transaction=False) as pipe:
        pipe.rpush(key, json.dumps({**payload, "node_id": str(node_id)}, default=str))
        pipe.expire(key, 600)
        pipe.execute()
    if not payload.get("ok", False):
        event_record(
            kind="COMMAND_FAILED",
            category=EventCategory.RUNTIME,
            now=now,
            node_id=node_id,
            deployment_id=(payload.get("deployment_id") or None),
            message=str(payload.get("error", "command failed"))[:500],
            data={"command_id": command_id, "command": payload.get("kind", "")},
        )
