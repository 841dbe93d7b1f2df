"""What a node can do to the shared Redis through its own ACL user (issue 28, item 2).

The Redis here is a private redis-server with real ACLs (never CI's shared one, which is never
reconfigured): the node enrolls over HTTP as an agent does, takes the Redis URL the controller
hands it, and then attacks as a hostile contributor would, with its own credentials.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import Client
from django.utils import timezone

from agent.protocol import (
    PROTOCOL_VERSION,
    job_cancel_key,
    job_stream_key,
    node_processing_key,
    node_queue_key,
    node_seen_key,
)
from apps.nodes.enrollment import enrollment_token_issue
from apps.nodes.models import Event, Node
from racon import ids
from racon.embedded import EmbeddedRedis, start_redis
from tests.factories import AccountFactory, hardware_profile

pytestmark = pytest.mark.django_db
_PORTS = itertools.count(41000)


@pytest.fixture
def acl_redis(tmp_path: Path, settings: Any) -> Iterator[EmbeddedRedis]:
    srv = start_redis(data_dir=tmp_path / "acl-redis", password="controller-" + "p" * 24)
    settings.NODE_REDIS_ACL = True
    settings.AGENT_REDIS_URL = srv.url
    settings.REDIS_URL = srv.url  # the controller's own user: it creates the node users
    try:
        yield srv
    finally:
        srv.stop()


def enroll(client: Client, name: str) -> dict[str, Any]:
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="t", now=timezone.now()
    )
    resp = client.post(
        "/api/agent/enroll",
        {
            "token": token,
            "node_name": name,
            "machine_id": f"{name}-machine",
            "agent_version": "0.1.0",
            "protocol_version": PROTOCOL_VERSION,
            "advertise_address": "127.0.0.1",
            "rpc_port": next(_PORTS),
            "hardware": hardware_profile(),
        },
        content_type="application/json",
    )
    assert resp.status_code == 201, resp.content
    return dict(resp.json())


def as_node(enrolled: dict[str, Any]) -> redis.Redis:
    return redis.Redis.from_url(enrolled["redis_url"], decode_responses=True, socket_timeout=10)


def test_a_node_user_runs_every_command_the_agent_sends(client: Client, acl_redis: Any) -> None:
    node = enroll(client, "honest")
    nid = node["node_id"]
    r = as_node(node)
    admin = redis.Redis.from_url(acl_redis.url, decode_responses=True)
    admin.rpush(node_queue_key(nid), '{"id": "c1"}')
    # agent/queue.py: take, recover, acknowledge, remember the id.
    assert r.ping()
    assert r.blmove(node_queue_key(nid), node_processing_key(nid), 1, "LEFT", "RIGHT")
    assert r.lrange(node_processing_key(nid), 0, -1) == ['{"id": "c1"}']
    assert r.lmove(node_processing_key(nid), node_queue_key(nid), "RIGHT", "LEFT")
    assert r.llen(node_queue_key(nid)) == 1
    r.blmove(node_queue_key(nid), node_processing_key(nid), 1, "LEFT", "RIGHT")
    with r.pipeline(transaction=True) as pipe:
        pipe.zadd(node_seen_key(nid), {"c1": 1.0})
        pipe.zremrangebyscore(node_seen_key(nid), 0, 0.5)
        pipe.expire(node_seen_key(nid), 60)
        pipe.lrem(node_processing_key(nid), 1, '{"id": "c1"}')
        pipe.execute()
    assert r.zscore(node_seen_key(nid), "c1") == 1.0
    # agent/runtime/stream.py: a batch under WATCH, the read-back, the cancel flag.
    key, cancel = job_stream_key("j1", nid), job_cancel_key("j1", nid)
    with r.pipeline(transaction=True) as pipe:
        pipe.watch(key)
        pipe.multi()
        pipe.xadd(key, {"type": "token", "seq": 0}, maxlen=8192, approximate=True)
        pipe.expire(key, 60)
        pipe.exists(cancel)
        pipe.execute()
    assert len(r.xrevrange(key, count=1)) == 1
    assert r.set(cancel, "1", ex=60) and r.exists(cancel) == 1


@pytest.mark.parametrize(
    "attack",
    [
        ("SETRANGE", "{k}", 536870911, "x"),  # 512 MB from one line
        ("APPEND", "{k}", "x"),
        ("SETBIT", "{k}", 4294967295, 1),
        ("LPUSH", "{k}", "x"),
        ("RPUSH", "{k}", "x"),
        ("HSET", "{k}", "f", "v"),
        ("SADD", "{k}", "x"),
        ("INCRBY", "{k}", 1),
        ("PFADD", "{k}", "x"),
        ("XGROUP", "CREATE", "{k}", "g", "$", "MKSTREAM"),
        ("SELECT", 1),
        ("DEL", "{k}"),
    ],
    ids=lambda a: str(a[0]),
)
def test_a_node_user_is_refused_every_write_the_agent_does_not_send(
    client: Client, acl_redis: Any, attack: tuple[Any, ...]
) -> None:
    node = enroll(client, "hostile")
    r = as_node(node)
    key = f"racon:n:{node['node_id']}:x"
    args = [a.format(k=key) if isinstance(a, str) else a for a in attack]
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.execute_command(*args)
    admin = redis.Redis.from_url(acl_redis.url, decode_responses=True)
    assert admin.exists(key) == 0
    assert int(admin.info("memory")["used_memory"]) < 64 * 1024**2


def test_a_node_whose_keys_grow_past_the_bound_is_revoked_with_an_event(
    client: Client, acl_redis: Any, settings: Any
) -> None:
    from apps.nodes.redis_bounds import nodes_redis_bound_check

    settings.NODE_MAX_REDIS_BYTES = 256 * 1024
    big, small = enroll(client, "flooder"), enroll(client, "quiet")
    r = as_node(big)
    for i in range(40):  # XADD is the agent's own write: 40 × 16 KiB on a key of its prefix
        r.xadd(f"racon:n:{big['node_id']}:junk:{i}", {"blob": "x" * 16384})
    as_node(small).xadd(job_stream_key("j1", small["node_id"]), {"type": "token", "seq": 0})
    revoked = nodes_redis_bound_check(now=timezone.now())
    assert revoked == [big["node_id"]]
    assert Node.objects.get(pk=big["node_id"]).revoked_at is not None
    assert Node.objects.get(pk=small["node_id"]).revoked_at is None
    ev = Event.objects.get(kind="NODE_REDIS_BOUND_EXCEEDED")
    assert str(ev.node_id) == big["node_id"] and ev.data["bytes"] > 256 * 1024
    assert ev.data["bound"] == 256 * 1024 and "NODE_MAX_REDIS_BYTES" in ev.message
    # Its user is gone with it, and the flood it left is deleted.
    with pytest.raises(redis.exceptions.AuthenticationError):
        as_node(big).ping()
    admin = redis.Redis.from_url(acl_redis.url, decode_responses=True)
    assert not list(admin.scan_iter(match=f"racon:n:{big['node_id']}:*"))
    assert admin.exists(job_stream_key("j1", small["node_id"])) == 1


def test_a_redis_the_launcher_owns_is_bounded_and_never_evicts(tmp_path: Path) -> None:
    from racon.redis_acl import redis_memory_warning

    srv = start_redis(data_dir=tmp_path / "owned")
    try:
        config = redis.Redis.from_url(srv.url, decode_responses=True).config_get("maxmemory*")
        assert int(config["maxmemory"]) > 0 and config["maxmemory-policy"] == "noeviction"
        assert redis_memory_warning(srv.url) is None
    finally:
        srv.stop()


def test_an_external_redis_without_a_bound_is_warned_about_and_never_reconfigured(
    tmp_path: Path, settings: Any
) -> None:
    from racon.redis_acl import redis_memory_warning

    srv = start_redis(data_dir=tmp_path / "external")
    try:
        admin = redis.Redis.from_url(srv.url, decode_responses=True)
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        warning = redis_memory_warning(srv.url)
        assert warning is not None
        assert "maxmemory is 0" in warning and "allkeys-lru, not noeviction" in warning
        assert admin.config_get("maxmemory*") == {
            **admin.config_get("maxmemory*"),
            "maxmemory": "0",
            "maxmemory-policy": "allkeys-lru",
        }
    finally:
        srv.stop()
    # The shared Redis (CI's): read, never changed.
    shared = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
    before = shared.config_get("*")
    redis_memory_warning(settings.REDIS_URL)
    assert shared.config_get("*") == before
