"""Writes for heartbeats: the cheap Redis path (a Lua script, no database query while nothing
changes) and the state change a heartbeat's telemetry implies.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from agent.protocol import HEARTBEATS_ZSET, heartbeat_key
from racon.ids import NodeId
from racon.redis import get_async_redis, get_redis

from .enrollment import NodeAuthError, credential_hash
from .events import event_record
from .models import EventCategory, Node
from .services import _cache_node, _meta_key, _refresh_cache, node_drain_advance, node_transition
from .states import (
    DRAIN_STATES,
    HEALTH_VERDICTS,
    ONLINE,
    NodeState,
)

S = NodeState
_scripts: dict[int, Any] = {}


class NodeRateLimited(Exception):
    """A node sent more heartbeats this minute than NODE_HEARTBEAT_RATE_PER_MINUTE (429): the
    refused beat moved nothing (its arrival time alone is kept: the node is alive); ``retry_after``
    is the seconds until the window ends."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NodeMirrorLost(Exception):
    """Redis lost the node's mirror again between its rebuild from the database and the retry (a
    second restart or flush): a transient fault (503, which the agent retries), never a verdict
    on the node's credential. Only the database says a node is revoked."""


def _rate_key(node_id: NodeId) -> str:
    return f"racon:node:{node_id}:hb-rate"


def _num(value: Any, field: str, *, integer: bool = False) -> float:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"telemetry.{field} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"telemetry.{field} must be a finite, non-negative number")
    return int(value) if integer else float(value)


def telemetry_clean(telemetry: Any) -> dict[str, Any]:
    """The heartbeat's telemetry with the fields the controller reads type-checked (ValueError names
    the field) and bounded: memory over NODE_MAX_MEMORY_BYTES and VRAM over NODE_MAX_VRAM_BYTES
    are clamped, and ``clamped`` lists what was. Pure."""
    if not isinstance(telemetry, dict):
        raise ValueError("telemetry must be an object")
    out = dict(telemetry)
    clamped: list[str] = []
    if "cpu_percent" in telemetry:
        out["cpu_percent"] = min(
            _num(telemetry.get("cpu_percent"), "cpu_percent"), 100.0 * settings.NODE_MAX_CORES
        )
    if "mem_available" in telemetry:
        mem = int(_num(telemetry.get("mem_available"), "mem_available", integer=True))
        if mem > settings.NODE_MAX_MEMORY_BYTES:
            mem = settings.NODE_MAX_MEMORY_BYTES
            clamped.append("mem_available")
        out["mem_available"] = mem
    gpu_free = telemetry.get("gpu_free") or []
    if not isinstance(gpu_free, list) or len(gpu_free) > 16:
        raise ValueError("telemetry.gpu_free must be a list of at most 16 numbers")
    frees = []
    for i, x in enumerate(gpu_free):
        v = int(_num(x, f"gpu_free[{i}]", integer=True))
        if v > settings.NODE_MAX_VRAM_BYTES:
            v = settings.NODE_MAX_VRAM_BYTES
            clamped.append(f"gpu_free[{i}]")
        frees.append(v)
    if "gpu_free" in telemetry:
        out["gpu_free"] = frees
    jobs = telemetry.get("jobs") or []
    if not isinstance(jobs, list):
        raise ValueError("telemetry.jobs must be a list")
    rpc = telemetry.get("rpc_worker") or {}
    if not isinstance(rpc, dict):
        raise ValueError("telemetry.rpc_worker must be an object")
    if clamped:
        out["clamped"] = clamped
    return out


# --- heartbeats --------------------------------------------------------------------------------


def heartbeat_target(
    *, current: str, wanted: str | None, busy: bool, drain_requested: bool
) -> str | None:
    """The state a heartbeat should move the node to, or None to stay. Pure."""
    if wanted == S.ERROR:
        return S.ERROR if current != S.ERROR else None
    if current in (S.UNINITIALIZED, S.ERROR):
        return None  # only a handshake leaves these
    if current == S.REGISTERING and wanted not in ONLINE:
        return None  # the agent's runtime checks have not passed yet
    if wanted in (S.UNINITIALIZED, S.REGISTERING):
        return None
    if drain_requested:
        return None if current in DRAIN_STATES else S.DRAINING
    target = S.BUSY if busy else S.READY
    return target if target != current else None


# One round trip per heartbeat: check the credential hash against the mirror, count the node's
# beats this minute (past NODE_HEARTBEAT_RATE_PER_MINUTE: 'rate' and the seconds left, and only
# the arrival time is kept, so a node that bursts is not taken for silent by the health sweep),
# record the time and telemetry, and return the mirrored state.
# Returns {} when the mirror is missing (rebuild it).
# The hashes compared are SHA-256 of 256-bit random credentials, so a plain comparison leaks nothing useful.
_HEARTBEAT_LUA = """
local meta = redis.call('HGETALL', KEYS[1])
if #meta == 0 then return {} end
local m = {}
for i = 1, #meta, 2 do m[meta[i]] = meta[i + 1] end
if m['cred'] == nil or m['cred'] == '' then return {'revoked'} end
if m['cred'] ~= ARGV[1] then return {'bad'} end
if tonumber(ARGV[10]) > 0 then
  local n = redis.call('INCR', KEYS[4])
  if redis.call('TTL', KEYS[4]) < 0 then redis.call('EXPIRE', KEYS[4], 60) end
  if n > tonumber(ARGV[10]) then
    redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
    return {'rate', tostring(redis.call('TTL', KEYS[4]))}
  end
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], 'at', ARGV[2], 'cpu_percent', ARGV[4], 'mem_available', ARGV[5], 'gpu_free', ARGV[6],
  'rpc_worker', ARGV[7], 'jobs', ARGV[8], 'telemetry', ARGV[9])
return {'ok', m['state'] or '', m['drain'] or '0'}
"""


def _heartbeat_script(r: Any) -> Any:
    """The registered script (EVALSHA after the first call), one per client."""
    script = _scripts.get(id(r))
    if script is None:
        script = _scripts[id(r)] = r.register_script(_HEARTBEAT_LUA)
    return script


async def node_heartbeat(
    *, node_id: NodeId, credential: str, payload: dict[str, Any], now: datetime
) -> str:
    """Record a heartbeat in Redis; touch the database only when the state must change.

    The controller's clock decides: the agent's ``sent_at`` is stored as telemetry only.
    """
    r = get_async_redis()
    # Bounded once more here, for callers that skip heartbeat_handle (idempotent).
    telemetry = telemetry_clean(payload.get("telemetry") or {})
    ts = now.timestamp()
    jobs = telemetry.get("jobs") or []
    args = [
        credential_hash(credential),
        ts,
        node_id,
        float(telemetry.get("cpu_percent") or 0.0),
        int(telemetry.get("mem_available") or 0),
        ",".join(str(int(x)) for x in telemetry.get("gpu_free") or []),
        int(bool((telemetry.get("rpc_worker") or {}).get("running"))),
        len(jobs),
        _json_dumps(telemetry),
        int(settings.NODE_HEARTBEAT_RATE_PER_MINUTE),
    ]
    # The rate is counted after the credential check (a stranger cannot spend a node's budget)
    # and before anything is recorded (a refused beat changes nothing).
    keys = [_meta_key(node_id), HEARTBEATS_ZSET, heartbeat_key(node_id), _rate_key(node_id)]
    script = _heartbeat_script(r)
    result = await script(keys=keys, args=args)
    if not result:
        # Redis lost the mirror (restart or flush): rebuild it from the database once, then retry.
        if await sync_to_async(_meta_from_db)(node_id) is None:
            raise NodeAuthError("unknown node", code="unknown_node")
        result = await script(keys=keys, args=args)
        if not result:
            raise NodeMirrorLost(
                "the controller's Redis lost this node's record again while it was rebuilt; retry"
            )
    if result[0] == "revoked":
        raise NodeAuthError("node has been revoked", code="node_revoked")
    if result[0] == "rate":
        raise NodeRateLimited(
            f"more than NODE_HEARTBEAT_RATE_PER_MINUTE ({settings.NODE_HEARTBEAT_RATE_PER_MINUTE})"
            " heartbeats from this node within a minute",
            retry_after=max(1, int(result[1])),
        )
    if result[0] != "ok":
        raise NodeAuthError("invalid node credential")
    _, current, drain = result[:3]
    if telemetry.get("clamped"):
        await sync_to_async(_telemetry_clamped)(node_id, telemetry["clamped"], now)
    target = heartbeat_target(
        current=current, wanted=payload.get("state"), busy=bool(jobs), drain_requested=drain == "1"
    )
    if target is not None:
        moved = await sync_to_async(_heartbeat_transition)(node_id, current, target, now, telemetry)
        if moved:
            current = target
    if current == S.DRAINING and not jobs:
        # The drain's backstop: its steps also run when a job ends and when a replacement is READY.
        await sync_to_async(node_drain_advance)(node_id=node_id, now=now)
    return current


def _telemetry_clamped(node_id: NodeId, fields: list[str], now: datetime) -> None:
    # One row an hour per node at most: never one per heartbeat.
    if get_redis().set(f"racon:node:{node_id}:clamped", 1, nx=True, ex=3600):
        event_record(
            kind="TELEMETRY_CLAMPED",
            category=EventCategory.SECURITY,
            now=now,
            node_id=node_id,
            message=f"heartbeat figures over the plausible bounds were clamped: {', '.join(fields)}",
            data={"fields": fields},
        )


def _json_dumps(value: Any) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))[:16384]


def _meta_from_db(node_id: NodeId) -> dict[str, str] | None:
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        return None
    _cache_node(node)
    return get_redis().hgetall(_meta_key(node_id))


def _heartbeat_transition(
    node_id: NodeId, current: str, target: str, now: datetime, telemetry: dict[str, Any]
) -> bool:
    if target == S.ERROR:
        kind, category, message = "NODE_FAULT", EventCategory.HEALTH, "agent reported a fatal fault"
    elif current in HEALTH_VERDICTS:
        kind, category, message = "HEARTBEAT_RESTORED", EventCategory.HEALTH, "heartbeat restored"
    elif current == S.REGISTERING:
        kind, category, message = "NODE_READY", EventCategory.LIFECYCLE, "runtime checks passed"
    else:
        kind, category, message = "NODE_STATE_CHANGED", EventCategory.EXECUTION, ""
    extra: dict[str, Any] = {"last_heartbeat_at": now}
    if "mem_available" in telemetry:
        # Never more free than the node has (ram_total was bounded at enrollment).
        total = Node.objects.filter(pk=node_id).values_list("ram_total", flat=True).first() or 0
        extra["ram_available"] = min(int(telemetry.get("mem_available") or 0), int(total))
    moved = node_transition(
        node_id=node_id,
        to=target,
        expected=current,
        now=now,
        kind=kind,
        category=category,
        message=message,
        extra=extra,
    )
    if not moved:
        _refresh_cache(node_id)  # the mirror was stale
    return moved
