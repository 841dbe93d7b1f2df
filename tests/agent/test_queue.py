"""Reliable-queue semantics on the real Redis (db 15)."""

from __future__ import annotations

import json
from typing import Any

from agent.protocol import node_processing_key, node_queue_key, node_seen_key
from agent.queue import CommandQueue, parse_command


def push(r: Any, node_id: str, cid: str, kind: str = "rescan_models", payload: Any = None) -> str:
    raw = json.dumps({"id": cid, "kind": kind, "payload": payload or {}, "issued_at": 0})
    r.rpush(node_queue_key(node_id), raw)  # the controller appends (protocol.QUEUE_PUSH_SIDE)
    return raw


def test_take_moves_the_oldest_command_into_processing(redis_client: Any, node_id: str) -> None:
    q = CommandQueue(redis_client, node_id)
    push(redis_client, node_id, "c1")
    push(redis_client, node_id, "c2")
    item = q.take(timeout=1)
    assert item is not None and item.id == "c1" and item.kind == "rescan_models"
    assert q.pending() == 1
    assert len(q.in_processing()) == 1


def test_take_times_out_with_none_on_an_empty_queue(redis_client: Any, node_id: str) -> None:
    assert CommandQueue(redis_client, node_id).take(timeout=0.1) is None


def test_ack_removes_from_processing_and_marks_seen(redis_client: Any, node_id: str) -> None:
    q = CommandQueue(redis_client, node_id)
    push(redis_client, node_id, "c1")
    item = q.take(timeout=1)
    assert item is not None
    q.ack(item)
    assert redis_client.llen(node_processing_key(node_id)) == 0
    assert q.is_duplicate("c1")
    assert redis_client.ttl(node_seen_key(node_id)) > 0


def test_a_crash_before_ack_is_recovered_in_order_on_restart(
    redis_client: Any, node_id: str
) -> None:
    first = CommandQueue(redis_client, node_id)
    for cid in ("c1", "c2", "c3"):
        push(redis_client, node_id, cid)
    a, b = first.take(timeout=1), first.take(timeout=1)
    assert a is not None and b is not None
    # ...the agent dies here: c1 and c2 were taken, never acknowledged.
    restarted = CommandQueue(redis_client, node_id)
    assert restarted.recover() == 2
    assert redis_client.llen(node_processing_key(node_id)) == 0
    order = []
    while (item := restarted.take(timeout=0.1)) is not None:
        order.append(item.id)
        restarted.ack(item)
    assert order == ["c1", "c2", "c3"]


def test_a_command_acknowledged_before_is_recognised_as_duplicate(
    redis_client: Any, node_id: str
) -> None:
    q = CommandQueue(redis_client, node_id)
    push(redis_client, node_id, "dup")
    item = q.take(timeout=1)
    assert item is not None
    assert not q.is_duplicate("dup")
    q.ack(item)
    push(redis_client, node_id, "dup")  # the controller re-sends it
    again = q.take(timeout=1)
    assert again is not None and again.id == "dup"
    assert q.is_duplicate("dup")


def test_ack_of_one_copy_leaves_an_identical_copy_in_processing(
    redis_client: Any, node_id: str
) -> None:
    q = CommandQueue(redis_client, node_id)
    push(redis_client, node_id, "same")
    push(redis_client, node_id, "same")
    a, b = q.take(timeout=1), q.take(timeout=1)
    assert a is not None and b is not None
    q.ack(a)
    assert len(q.in_processing()) == 1


def test_old_seen_ids_are_pruned_after_the_ttl(redis_client: Any, node_id: str) -> None:
    q = CommandQueue(redis_client, node_id, seen_ttl=60)
    redis_client.zadd(node_seen_key(node_id), {"ancient": 1.0})  # handled in 1970
    push(redis_client, node_id, "new")
    item = q.take(timeout=1)
    assert item is not None
    q.ack(item)
    assert not q.is_duplicate("ancient")
    assert q.is_duplicate("new")


def test_malformed_commands_are_parsed_without_raising() -> None:
    assert parse_command("not json").error is not None
    assert "expected a JSON object" in (parse_command("[1]").error or "")
    assert "'id'" in (parse_command('{"kind": "rpc_start"}').error or "")
    assert "'kind'" in (parse_command('{"id": "x"}').error or "")
    assert "'payload'" in (
        parse_command('{"id": "x", "kind": "rpc_start", "payload": 3}').error or ""
    )
    bad = parse_command('{"id": "keep-me", "kind": 5}')
    assert bad.command is None and bad.id == "keep-me"
    ok = parse_command('{"id": "x", "kind": "teleport", "payload": null}')
    assert ok.command is not None and ok.kind == "teleport" and ok.command["payload"] == {}
