"""The command bus to agents: a command onto the node's own Redis queue, its result back to
whoever waits for it, and the job cancel flag the primary's runtime polls. The one writer of
``racon:n:{node}:commands``, ``racon:cmd:{id}:node``, ``racon:cmdresult:{id}`` and
``racon:n:{node}:job:{job}:cancel``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.utils.crypto import salted_hmac

from agent.protocol import (
    COMMAND_REFUSALS,
    command_signature,
    job_cancel_key,
    new_id,
    node_queue_key,
)
from racon.ids import JobId, NodeId
from racon.redis import get_redis, get_redis_blocking

from .errors import ReportRefused
from .events import event_record
from .models import EventCategory, Node
from .services import _meta_key

# How long a cancel flag outlives the job it stops: longer than any stream.
CANCEL_FLAG_TTL_SECONDS = 3600


def job_cancel_flag(*, job_id: JobId, node_id: NodeId) -> None:
    """Ask the job's runtime on ``node_id`` to stop: it polls this flag between tokens."""
    get_redis().set(job_cancel_key(job_id, node_id), 1, ex=CANCEL_FLAG_TTL_SECONDS)


def job_cancel_clear(*, job_id: JobId, node_id: NodeId) -> None:
    """Lift a cancel flag (a job handed back to the same primary after a failover)."""
    get_redis().delete(job_cancel_key(job_id, node_id))


def _result_key(command_id: str) -> str:
    return f"racon:cmdresult:{command_id}"


def _command_node_key(command_id: str) -> str:
    return f"racon:cmd:{command_id}:node"


# Longer than the longest command_wait (a model transfer, MODEL_FETCH_TIMEOUT 1800 s), so a slow
# but honest result still finds whom its command was sent to.
COMMAND_NODE_TTL_SECONDS = 2 * 3600


def node_command_key(*, node_id: NodeId, credential_hash: str) -> bytes:
    """The key a node's commands are signed with (docs/design/serving.md, "The command
    envelope"): derived from SECRET_KEY, the node id and its current credential's hash, so nothing
    new is stored and a re-enrollment (a new credential) gives a new key."""
    value = f"{node_id}:{credential_hash}"
    return salted_hmac("racon.nodes.command_key", value, algorithm="sha256").digest()


def _credential_hash_of(node_id: NodeId) -> str:
    # The heartbeat mirror first (no query on the run_job path); the database when it is cold.
    cached = get_redis().hget(_meta_key(node_id), "cred")
    if cached:
        return str(cached)
    found = Node.objects.filter(pk=node_id).values_list("credential_hash", flat=True).first()
    return str(found or "")


def command_send(*, node_id: NodeId, kind: str, payload: Mapping[str, Any]) -> str:
    """Append a command, signed with the node's command key, to the node's own queue and
    remember which node it went to.

    The two writes are one MULTI: a result can never arrive for a command whose node is unknown.
    """
    command_id = new_id()
    issued_at = time.time()
    node = NodeId(str(node_id))
    # Signed as the agent will read it back (int keys become strings, tuples lists).
    wire: dict[str, Any] = json.loads(json.dumps(payload))
    key = node_command_key(node_id=node, credential_hash=_credential_hash_of(node))
    body = {
        "id": command_id,
        "kind": kind,
        "payload": wire,
        "issued_at": issued_at,
        "node_id": node,
        "sig": command_signature(
            key, node_id=node, command_id=command_id, kind=kind, payload=wire,
            issued_at=issued_at,
        ),
    }  # fmt: skip
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
    *, node_id: NodeId, command_id: str | None, payload: dict[str, Any], now: datetime
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
        if payload.get("code") in COMMAND_REFUSALS:
            _refusal_event(node_id=node_id, command_id=command_id, payload=payload, now=now)
        raise ReportRefused(
            f"command_result refused: command {command_id} was sent to another node, not to node {node_id}",
            code="not_command_node",
        )
    key = _result_key(command_id)
    with r.pipeline(transaction=False) as pipe:
        pipe.rpush(key, json.dumps({**payload, "node_id": str(node_id)}, default=str))
        pipe.expire(key, 600)
        pipe.execute()
    if payload.get("code") in COMMAND_REFUSALS:
        _refusal_event(node_id=node_id, command_id=command_id, payload=payload, now=now)
    elif not payload.get("ok", False):
        event_record(
            kind="COMMAND_FAILED",
            category=EventCategory.RUNTIME,
            now=now,
            node_id=node_id,
            deployment_id=(payload.get("deployment_id") or None),
            message=str(payload.get("error", "command failed"))[:500],
            data={"command_id": command_id, "command": payload.get("kind", "")},
        )


def _refusal_event(
    *, node_id: NodeId, command_id: str, payload: dict[str, Any], now: datetime
) -> None:
    # Someone wrote to this node's queue without the controller's signature, replayed a signed
    # command, or moved one from another node's queue: the node refused it.
    event_record(
        kind="COMMAND_REFUSED",
        category=EventCategory.SECURITY,
        now=now,
        node_id=node_id,
        message=str(payload.get("error", "command refused"))[:500],
        data={"command_id": command_id, "code": payload["code"]},
    )
