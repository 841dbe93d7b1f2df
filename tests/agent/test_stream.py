from __future__ import annotations

import json
import threading
from typing import Any

from agent.protocol import job_cancel_key, job_stream_key
from agent.runtime.stream import StreamWriter, append_error, last_seq
from tests.agent.harness import read_stream

NODE = "node-stream-test"
USAGE = {
    "prompt_tokens": 3,
    "completion_tokens": 2,
    "total_tokens": 5,
    "ttft_ms": 1.0,
    "tokens_per_s": 9.0,
}


def test_chunks_and_done_are_written_in_seq_order_with_a_ttl(
    redis_client: Any, job_id: str
) -> None:
    w = StreamWriter(redis_client, job_id, threading.Event(), node_id=NODE)
    for t in ("Hel", "lo", "!"):
        w.chunk(t)
    w.done("stop", USAGE)  # type: ignore[arg-type]
    entries = read_stream(redis_client, job_id)
    assert [e["seq"] for e in entries] == ["0", "1", "2", "3"]
    assert [e["type"] for e in entries] == ["chunk", "chunk", "chunk", "done"]
    assert "".join(e["text"] for e in entries) == "Hello!"
    assert entries[-1]["finish_reason"] == "stop"
    assert json.loads(entries[-1]["usage"])["completion_tokens"] == 2
    assert 0 < redis_client.ttl(job_stream_key(job_id, NODE)) <= 3600


def test_the_cancel_key_sets_the_cancel_event_on_the_next_write(
    redis_client: Any, job_id: str
) -> None:
    cancel = threading.Event()
    w = StreamWriter(redis_client, job_id, cancel, node_id=NODE)
    w.chunk("a")
    redis_client.set(job_cancel_key(job_id, NODE), "1")
    w.chunk("b")
    w.close()
    assert cancel.is_set()


def test_append_error_continues_the_seq_and_never_writes_a_second_end(
    redis_client: Any, job_id: str
) -> None:
    w = StreamWriter(redis_client, job_id, threading.Event(), node_id=NODE)
    w.chunk("x")
    w.close()
    append_error(redis_client, job_id, "RPC worker disconnected", node_id=NODE)
    append_error(redis_client, job_id, "again", node_id=NODE)
    entries = read_stream(redis_client, job_id)
    assert [(e["seq"], e["type"]) for e in entries] == [("0", "chunk"), ("1", "error")]
    assert entries[-1]["text"] == "RPC worker disconnected"
    assert last_seq(redis_client, job_id, NODE) == 1
