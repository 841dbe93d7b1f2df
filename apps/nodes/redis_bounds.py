"""A node's own keys in the shared Redis, bounded (issue 28): a node whose keys hold more than
NODE_MAX_REDIS_BYTES is revoked, with an event, and what it left is deleted.

A Redis ACL cannot bound memory (racon/redis_acl.py): a node may XADD, SET and ZADD under its own
prefix ``racon:n:<id>:``, and that Redis is also the broker, the channel layer and every queue. So
a beat task measures: one SCAN over the node prefix (at most NODE_REDIS_SCAN_MAX_KEYS keys a run,
so its cost is bounded whatever a node writes) and MEMORY USAGE of each key, pipelined. The
command queue and processing list are left out of the sum: the controller writes those, and an
offline node's backlog is not the node's doing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime

from django.conf import settings

from agent.protocol import NODE_PREFIX, node_processing_key, node_queue_key
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis

from .enrollment import node_revoke
from .events import event_record
from .models import EventCategory, Node

log = logging.getLogger("racon.nodes")
_BATCH = 500


def node_redis_usage(*, max_keys: int) -> dict[str, tuple[int, int]]:
    """Node id → (bytes, keys) of the keys under its prefix that the node writes, from one
    bounded SCAN (MEMORY USAGE, sampled for aggregates)."""
    r = get_redis()
    usage: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    batch: list[tuple[str, str]] = []

    def measure() -> None:
        with r.pipeline(transaction=False) as pipe:
            for _, key in batch:
                pipe.memory_usage(key, samples=5)
            sizes = pipe.execute(raise_on_error=False)
        for (node_id, _), size in zip(batch, sizes, strict=True):
            if isinstance(size, int):
                usage[node_id][0] += size
                usage[node_id][1] += 1
        batch.clear()

    for seen, key in enumerate(r.scan_iter(match=f"{NODE_PREFIX}*", count=1000)):
        if seen >= max_keys:
            log.warning("node key check stopped after %d keys (NODE_REDIS_SCAN_MAX_KEYS)", max_keys)
            break
        node_id = key[len(NODE_PREFIX) :].split(":", 1)[0]
        if key in (node_queue_key(node_id), node_processing_key(node_id)):
            continue
        batch.append((node_id, key))
        if len(batch) >= _BATCH:
            measure()
    if batch:
        measure()
    return {n: (b, k) for n, (b, k) in usage.items()}


def nodes_redis_bound_check(*, now: datetime) -> list[str]:
    """Revoke every node whose own keys hold more than NODE_MAX_REDIS_BYTES (NODE_REDIS_BOUND_EXCEEDED)
    and delete its keys; returns the ids revoked. 0 turns the check off."""
    bound = int(settings.NODE_MAX_REDIS_BYTES)
    if bound <= 0:
        return []
    over = {
        n: (b, k)
        for n, (b, k) in node_redis_usage(max_keys=int(settings.NODE_REDIS_SCAN_MAX_KEYS)).items()
        if b > bound
    }
    if not over:
        return []
    live = {
        str(pk)
        for pk in Node.objects.filter(pk__in=list(over), revoked_at__isnull=True).values_list(
            "pk", flat=True
        )
    }
    revoked = []
    for node_id in sorted(live):
        size, keys = over[node_id]
        event_record(
            kind="NODE_REDIS_BOUND_EXCEEDED",
            category=EventCategory.SECURITY,
            now=now,
            node_id=NodeId(node_id),
            message=(
                f"the node's Redis keys hold {size} bytes in {keys} keys, over "
                f"NODE_MAX_REDIS_BYTES ({bound}): revoked"
            ),
            data={"bytes": size, "keys": keys, "bound": bound},
        )
        node_revoke(node_id=ids.node_id(node_id), now=now)
        revoked.append(node_id)
    for node_id in over:  # revoked now or before: what it left goes
        _delete_prefix(NodeId(node_id))
    return revoked


def _delete_prefix(node_id: NodeId) -> None:
    r = get_redis()
    keys: list[str] = []
    for key in r.scan_iter(match=f"{NODE_PREFIX}{node_id}:*", count=1000):
        keys.append(key)
        if len(keys) >= _BATCH:
            r.unlink(*keys)
            keys.clear()
    if keys:
        r.unlink(*keys)
