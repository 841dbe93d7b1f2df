"""Writing a job's token stream to Redis (protocol.StreamEntry), off the generation thread.

Generation must not wait on Redis: chunks go through an in-process queue to a writer thread that
pipelines every chunk waiting at that moment together with one EXISTS on the cancel key, so a token
costs the generator a queue put and the cancel check rides along with writes that happen anyway.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any

import redis

from agent.protocol import (
    STREAM_MAXLEN,
    STREAM_TTL_SECONDS,
    StreamUsage,
    job_cancel_key,
    job_stream_key,
)

log = logging.getLogger("agent.runtime.stream")

_STOP = object()


def entry(
    seq: int,
    type_: str,
    text: str = "",
    finish_reason: str = "",
    usage: Any = None,
    *,
    ids: list[int] | None = None,
    attempt: int = 1,
    code: str = "",
    probs: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """One stream entry (protocol.StreamEntry; docs/design/serving.md, the stream protocol)."""
    out = {
        "seq": str(seq),
        "attempt": str(attempt),
        "type": type_,
        "text": text,
        "finish_reason": finish_reason,
        "usage": json.dumps(usage) if usage is not None else "",
    }
    if type_ == "chunk":
        out["ids"] = json.dumps(ids or [])
        out["n"] = str(len(ids) if ids is not None else 1)
        if probs is not None:
            out["probs"] = json.dumps(probs, separators=(",", ":"))
    if code:
        out["code"] = code
    return out


class StreamWriter:
    """One job's stream. `cancel` is set when the cancel key is seen (or by the caller)."""

    def __init__(
        self,
        client: redis.Redis,
        job_id: str,
        cancel: threading.Event,
        *,
        node_id: str,
        ttl: int = STREAM_TTL_SECONDS,
        attempt: int = 1,
        start: bool = True,
    ) -> None:
        self.attempt = attempt
        self.r = client
        self.job_id = job_id
        self.key = job_stream_key(job_id, node_id)
        self.cancel_key = job_cancel_key(job_id, node_id)
        self.cancel = cancel
        self.ttl = ttl
        self.seq = 0
        self.error: str | None = None  # set when Redis failed; generation should stop
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._expire_set = False
        self._thread = threading.Thread(target=self._run, name=f"stream-{job_id[:8]}", daemon=True)
        if start:
            self._thread.start()

    # --- generator side -----------------------------------------------------------------------

    def chunk(
        self, text: str, ids: list[int] | None = None, probs: list[dict[str, Any]] | None = None
    ) -> None:
        """Text and the token ids it came from; a chunk with ids but no text yet (an incomplete
        UTF-8 sequence) is still written, so every token is counted and kept for failover.
        ``probs``: the tokens' logprobs, when the job asked for them."""
        if text or ids:
            self._q.put(
                entry(self._next(), "chunk", text, ids=ids, attempt=self.attempt, probs=probs)
            )

    def done(self, finish_reason: str, usage: StreamUsage) -> None:
        self._q.put(entry(self._next(), "done", "", finish_reason, usage, attempt=self.attempt))
        self.close()

    def fail(self, message: str, usage: StreamUsage | None = None, *, code: str = "") -> None:
        self._q.put(
            entry(self._next(), "error", message, "error", usage, attempt=self.attempt, code=code)
        )
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Flush every queued entry (the final one included) before returning."""
        self._q.put(_STOP)
        self._thread.join(timeout)

    def _next(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    # --- writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._q.get()]
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            entries = [b for b in batch if b is not _STOP]
            stopping = len(entries) != len(batch)
            if entries:
                self._write(entries)

    def _write(self, entries: list[dict[str, str]]) -> None:
        final = entries[-1]["type"] != "chunk"
        try:
            pipe = self.r.pipeline(transaction=False)
            for e in entries:
                pipe.xadd(self.key, e, maxlen=STREAM_MAXLEN, approximate=True)
            if not self._expire_set or final:
                # TTL from the first entry, renewed at the end so readers get the full window.
                pipe.expire(self.key, self.ttl)
                self._expire_set = True
            pipe.exists(self.cancel_key)
            results = pipe.execute()
        except redis.RedisError as exc:
            if self.error is None:
                log.error("job %s: cannot write its stream: %s", self.job_id, exc)
            self.error = f"stream write failed: {exc}"
            self.cancel.set()
            return
        if results[-1]:
            self.cancel.set()


class DirectStreamWriter(StreamWriter):
    """The same stream, written on the caller's thread: for a relay (the llama-server primary),
    whose generation runs in another process and never waits on this thread, so a handoff to a
    writer thread would only add a thread wake-up per token on cores the engine needs."""

    def __init__(
        self, client: redis.Redis, job_id: str, cancel: threading.Event, **kw: Any
    ) -> None:
        super().__init__(client, job_id, cancel, start=False, **kw)

    def chunk(
        self, text: str, ids: list[int] | None = None, probs: list[dict[str, Any]] | None = None
    ) -> None:
        if text or ids:
            self._write(
                [entry(self._next(), "chunk", text, ids=ids, attempt=self.attempt, probs=probs)]
            )

    def done(self, finish_reason: str, usage: StreamUsage) -> None:
        self._write([entry(self._next(), "done", "", finish_reason, usage, attempt=self.attempt)])

    def fail(self, message: str, usage: StreamUsage | None = None, *, code: str = "") -> None:
        self._write(
            [entry(self._next(), "error", message, "error", usage, attempt=self.attempt, code=code)]
        )

    def close(self, timeout: float = 5.0) -> None:
        return


def last_seq(client: redis.Redis, job_id: str, node_id: str) -> int:
    """The seq of the newest entry of a job's stream, or -1 when there is none."""
    rows = client.xrevrange(job_stream_key(job_id, node_id), count=1)
    if not rows:
        return -1
    fields = rows[0][1] or {}
    raw = fields.get("seq", fields.get(b"seq", "-1"))
    try:
        return int(raw.decode() if isinstance(raw, bytes) else raw)
    except (TypeError, ValueError):
        return -1


def stream_has_end(client: redis.Redis, job_id: str, node_id: str) -> bool:
    rows = client.xrevrange(job_stream_key(job_id, node_id), count=1)
    if not rows:
        return False
    fields = rows[0][1] or {}
    t = fields.get("type", fields.get(b"type", ""))
    t = t.decode() if isinstance(t, bytes) else t
    return t in ("done", "error")


def append_error(
    client: redis.Redis,
    job_id: str,
    message: str,
    *,
    node_id: str,
    ttl: int = STREAM_TTL_SECONDS,
    attempt: int = 1,
    code: str = "",
) -> None:
    """End a job's stream with an error from outside the process that was writing it.

    Used when the writer died (primary aborted) or never started (bad deployment); continues the
    seq numbering so a reader that orders by seq sees one gap-free stream.
    """
    if stream_has_end(client, job_id, node_id):
        return  # the job ended before its process died; never write a second end
    seq = last_seq(client, job_id, node_id) + 1
    key = job_stream_key(job_id, node_id)
    pipe = client.pipeline(transaction=False)
    pipe.xadd(
        key,
        entry(seq, "error", message, "error", attempt=attempt, code=code),
        maxlen=STREAM_MAXLEN,
        approximate=True,
    )
    pipe.expire(key, ttl)
    pipe.execute()


def append_done(
    client: redis.Redis, job_id: str, finish_reason: str, usage: StreamUsage, *, node_id: str
) -> None:
    seq = last_seq(client, job_id, node_id) + 1
    key = job_stream_key(job_id, node_id)
    pipe = client.pipeline(transaction=False)
    pipe.xadd(
        key, entry(seq, "done", "", finish_reason, usage), maxlen=STREAM_MAXLEN, approximate=True
    )
    pipe.expire(key, STREAM_TTL_SECONDS)
    pipe.execute()
