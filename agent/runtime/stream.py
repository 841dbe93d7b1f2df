"""Writing a job's token stream to Redis (protocol.StreamEntry), off the generation thread.

Generation must not wait on Redis: chunks go through an in-process queue to a writer thread that
pipelines every chunk waiting at that moment together with one EXISTS on the cancel key, so a token
costs the generator a queue put and the cancel check rides along with writes that happen anyway.

A write that fails on the connection (Redis restarting) is retried with capped backoff for
WRITE_RETRY_SECONDS, past the ~17 s the controller's clients retry (racon/redis.py), so a restart
costs the job a pause, not its stream. Retries never duplicate an entry or change the order: a
batch goes in one round trip, on a client that never re-sends on its own (no_retry_client), and
Redis runs its commands in order, so what lands of it is a prefix (all of it or none for the
batches that set the TTL, the first and the last, which go in MULTI/EXEC so the TTL lands with
their entries; the others skip MULTI/EXEC's three extra replies per token). Before each retry the
stream is read back to drop what did land (a reply lost after the commands ran). Only the missing
tail is sent again, before any later entry.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agent.config import (
    COALESCE_BUSY_ENV,
    COALESCE_DEFAULTS,
    COALESCE_ENV,
    ConfigError,
    stream_coalesce_seconds,
)
from agent.protocol import (
    STREAM_MAXLEN,
    STREAM_TTL_SECONDS,
    StreamEntry,
    StreamUsage,
    job_cancel_key,
    job_stream_key,
)
from agent.retry import RetryStopped, retry_call

log = logging.getLogger("agent.runtime.stream")

_STOP = object()

# How long one write is retried when Redis is unreachable: longer than the controller's clients
# retry (about 17 s), so the stream outlasts a restart they outlast too. The stream follower waits
# STREAM_IDLE_TIMEOUT_SECONDS from its own reconnect (60 s by default), longer still.
WRITE_RETRY_SECONDS = 20.0
WRITE_RETRY_BASE = 0.05
WRITE_RETRY_CAP = 1.0
# What a second try can fix: the connection (a restart, LOADING while the appendonly file is read
# back, the node's ACL user not restored yet); WatchError stays for writers that WATCH.
RETRYABLE: tuple[type[redis.RedisError], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.WatchError,
)
# Entries read back to find where a retried batch stands: the batch plus room for a superseded
# attempt's late entries in the same key.
_READ_BACK_SLACK = 64


def entry(
    seq: int,
    type_: Literal["chunk", "done", "error"],
    text: str = "",
    finish_reason: str = "",
    usage: Any = None,
    *,
    ids: list[int] | None = None,
    attempt: int = 1,
    code: str = "",
    probs: list[dict[str, Any]] | None = None,
    lens: list[int] | None = None,
) -> StreamEntry:
    """One stream entry (protocol.StreamEntry; docs/design/serving.md, the stream protocol).

    A chunk may carry several tokens (coalesced): ``lens`` gives each token's share of ``text``
    in characters, so a reader can cut the chunk on a token boundary; written only for more than
    one token (one token owns the whole text). A chunk has no ``finish_reason`` or ``usage``."""
    out: StreamEntry = {"seq": str(seq), "attempt": str(attempt), "type": type_, "text": text}
    if type_ == "chunk":
        out["ids"] = json.dumps(ids or [], separators=(",", ":"))
        if lens is not None and len(lens) > 1:
            out["lens"] = json.dumps(lens, separators=(",", ":"))
        if probs is not None:
            out["probs"] = json.dumps(probs, separators=(",", ":"))
    else:
        out["finish_reason"] = finish_reason
        out["usage"] = json.dumps(usage) if usage is not None else ""
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
        retry_seconds: float = WRITE_RETRY_SECONDS,
    ) -> None:
        self.attempt = attempt
        self.retry_seconds = retry_seconds
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
        self,
        text: str,
        ids: list[int] | None = None,
        probs: list[dict[str, Any]] | None = None,
        lens: list[int] | None = None,
    ) -> None:
        """Text and the token ids it came from; a chunk with ids but no text yet (an incomplete
        UTF-8 sequence) is still written, so every token is counted and kept for failover.
        ``probs``: the tokens' logprobs, when the job asked for them; ``lens``: each token's
        characters of ``text`` when the chunk carries several (coalesced)."""
        if text or ids:
            self._q.put(
                entry(
                    self._next(),
                    "chunk",
                    text,
                    ids=ids,
                    attempt=self.attempt,
                    probs=probs,
                    lens=lens,
                )  # fmt: skip
            )

    def done(self, finish_reason: str, usage: StreamUsage) -> None:
        self._q.put(entry(self._next(), "done", "", finish_reason, usage, attempt=self.attempt))
        self.close()

    def fail(self, message: str, usage: StreamUsage | None = None, *, code: str = "") -> None:
        self._q.put(
            entry(self._next(), "error", message, "error", usage, attempt=self.attempt, code=code)
        )
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Flush every queued entry (the final one included) before returning; by default waits
        as long as a write may be retried, plus a little."""
        self._q.put(_STOP)
        self._thread.join(self.retry_seconds + 5.0 if timeout is None else timeout)

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

    def _write(self, entries: list[StreamEntry]) -> None:
        final = entries[-1]["type"] != "chunk"
        pending = entries
        tries = 0
        last: list[BaseException] = []
        if self.error is None:
            # The common case costs one transaction and nothing else; a failure goes on to the
            # retries below (which read back first: the failed try may have landed).
            tries = 1
            try:
                cancelled = self._send(entries, final)
            except RETRYABLE as exc:
                last[:] = [exc]
                log.warning(
                    "job %s: stream write failed (%s); retrying for up to %.0f s",
                    self.job_id,
                    exc,
                    self.retry_seconds,
                )
            except redis.RedisError as exc:
                self._failed(exc)
                return
            else:
                if cancelled:
                    self.cancel.set()
                return

        def attempt() -> bool:
            nonlocal pending, tries
            tries += 1
            if tries > 1:
                pending = self._not_landed(pending)
                if not pending:
                    return False  # all of it landed before the reply was lost
            return self._send(pending, final)

        def retrying(exc: BaseException, failures: int, delay: float) -> None:
            last[:] = [exc]
            if failures == 1 and tries == 1:
                log.warning(
                    "job %s: stream write failed (%s); retrying for up to %.0f s",
                    self.job_id,
                    exc,
                    self.retry_seconds,
                )

        # After a write has failed for good, later ones (the end entry) get one try each.
        deadline = time.monotonic() + (self.retry_seconds if self.error is None else 0.0)
        try:
            cancelled = retry_call(
                attempt,
                retry_on=RETRYABLE,
                base=WRITE_RETRY_BASE,
                cap=WRITE_RETRY_CAP,
                give_up=lambda: time.monotonic() >= deadline,
                on_retry=retrying,
            )
        except RetryStopped:
            self._failed(last[0] if last else TimeoutError("stream write retry window spent"))
            return
        except redis.RedisError as exc:
            self._failed(exc)
            return
        if tries > 1:
            log.info("job %s: stream write went through after %d tries", self.job_id, tries)
        if cancelled:
            self.cancel.set()

    def _send(self, entries: list[StreamEntry], final: bool) -> bool:
        """One batch in one round trip; returns whether the cancel key is set.

        Sent on a client that never retries by itself (``no_retry_client``): a lost connection
        raises, and _write's own retry reads back what landed before sending the rest. Only a
        batch that sets the TTL is a transaction (the module's docstring says why)."""
        expire = not self._expire_set or final
        with no_retry_client(self.r).pipeline(transaction=expire) as pipe:
            for e in entries:
                pipe.xadd(self.key, e, maxlen=STREAM_MAXLEN, approximate=True)
            if expire:
                # TTL from the first entry, renewed at the end so readers get the full window.
                pipe.expire(self.key, self.ttl)
            pipe.exists(self.cancel_key)
            results = pipe.execute()
        self._expire_set = True
        return bool(results[-1])

    def _not_landed(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        """The entries of a batch that are not in the stream: what lands is a prefix (a
        transaction all of it or none), told by the newest entry of this attempt."""
        rows = self.r.xrevrange(self.key, count=len(entries) + _READ_BACK_SLACK)
        for _id, fields in rows:
            if (_field(fields, "attempt") or "1") == str(self.attempt):
                try:
                    newest = int(_field(fields, "seq"))
                except ValueError:
                    continue
                return [e for e in entries if int(e["seq"]) > newest]
        return entries

    def _failed(self, exc: BaseException) -> None:
        if self.error is None:
            log.error("job %s: cannot write its stream: %s", self.job_id, exc)
        self.error = f"stream write failed: {exc}"
        self.cancel.set()


def _coalesce_seconds(name: str) -> float:
    try:
        return stream_coalesce_seconds(os.environ.get(name), name=name)
    except ConfigError:
        # The agent refuses such a value at start (agent/config.py names it); anything else that
        # imports this module keeps the default.
        return COALESCE_DEFAULTS[name]


# The relay's coalescing (docs/design/serving.md, "The stream protocol"): the longest a token
# waits in the agent for others, and the most tokens in one entry. Only a fast stream's tokens
# wait (one that came at more than one token per window); a slow stream's are written at once.
STREAM_COALESCE_SECONDS = _coalesce_seconds(COALESCE_ENV)
STREAM_COALESCE_MAX_EVENTS = 256
# While a primary runs this many jobs or more, its streams use the busy window: the engine keeps
# the cores busy, and every entry's CPU on the way (agent, Redis, daphne) is taken from it, about
# twice over (llama.cpp's threads run in lockstep: docs/design/serving.md, "A core taken from the
# engine costs it twice"). A stream slower than one token per busy window still gets each token
# at once.
STREAM_COALESCE_BUSY_SECONDS = _coalesce_seconds(COALESCE_BUSY_ENV)
STREAM_COALESCE_BUSY_STREAMS = 8


class EngineError(Exception):
    """llama-server reported an error inside its stream (an ``error:`` line)."""


class EventReader:
    """llama-server's streamed ``/completion`` answer, read in batches straight off its socket.

    ``batch()`` returns every ``data:`` event already received, and goes on reading while more
    is readable at once, for at most ``window`` seconds or ``max_events`` events: under load one
    recv, one parse pass and one Redis entry carry many tokens. A fast stream's batch (the last
    one came at more than one event per window) stays open for the window; a slow stream's token
    is returned at once. ``window`` may be a callable, asked at each batch (the primary's: longer
    while it is busy, STREAM_COALESCE_BUSY_SECONDS).
    Chunked transfer coding (cpp-httplib's, one chunk per event) is decoded here, and a ``data:``
    line split across chunks or reads is joined. Returns None at the end of the body.
    """

    def __init__(
        self,
        resp: http.client.HTTPResponse,
        *,
        window: float | Callable[[], float] = STREAM_COALESCE_SECONDS,
        max_events: int = STREAM_COALESCE_MAX_EVENTS,
    ) -> None:
        self.fp = resp.fp  # headers were read through it: what it buffered is the body's start
        self.chunked = bool(resp.chunked)
        self.window = window
        self.max_events = max_events
        self.raw = bytearray()  # undecoded chunked bytes
        self.body = bytearray()  # decoded bytes not yet split into lines
        self.left = 0  # chunk bytes still to come (-1: the CRLF after a chunk)
        self.eof = False
        self._poll = select.poll()
        self._poll.register(resp.fp.fileno(), select.POLLIN)  # the socket under the reader
        self._returned_at: float | None = None  # when the last batch was handed on (monotonic)
        self._fast = False  # the last batch came in at more than one event per window

    def batch(self) -> list[dict[str, Any]] | None:
        """The events received, handed on at once unless the stream is fast: then the batch
        stays open for the rest of the window, so that a fast stream's tokens travel a few at a
        time (each waits at most ``window``) instead of one wake-up of every process per token.
        A stream's first batch, a slow stream's and its last event are never held."""
        events: list[dict[str, Any]] = []
        first = 0.0
        window = self.window() if callable(self.window) else self.window
        while not self.eof:
            data = self.fp.read1(1 << 16)  # what is buffered, else one recv (blocking)
            if not data:
                self.eof = True
                break
            self._decode(data)
            events += self._events()
            if not events:
                continue
            if events[-1].get("stop") or len(events) >= self.max_events:
                return self._handed(events, window)
            now = time.monotonic()
            first = first or now
            left = first + window - now if self._fast else 0.0
            if left <= 0 or not self._poll.poll(left * 1000):
                return self._handed(events, window)
        return self._handed(events, window) if events else None

    def _handed(self, events: list[dict[str, Any]], window: float) -> list[dict[str, Any]]:
        now = time.monotonic()
        if self._returned_at is not None:
            self._fast = (now - self._returned_at) / len(events) < window
        self._returned_at = now
        return events

    def _decode(self, data: bytes) -> None:
        if not self.chunked:
            self.body += data
            return
        raw = self.raw
        raw += data
        i, n = 0, len(raw)
        while i < n:
            if self.left > 0:
                take = min(self.left, n - i)
                self.body += raw[i : i + take]
                i += take
                self.left -= take
                if self.left == 0:
                    self.left = -1
            elif self.left < 0:
                if n - i < 2:
                    break
                i += 2
                self.left = 0
            else:
                j = raw.find(b"\r\n", i)
                if j < 0:
                    break
                size = int(bytes(raw[i:j]).split(b";", 1)[0] or b"0", 16)
                i = j + 2
                if size == 0:
                    self.eof = True
                    break
                self.left = size
        del raw[:i]

    def _events(self) -> list[dict[str, Any]]:
        body = self.body
        cut = body.rfind(b"\n")
        if cut < 0:
            return []
        lines = bytes(body[:cut]).split(b"\n")
        del body[: cut + 1]
        out: list[dict[str, Any]] = []
        for line in lines:
            if line.startswith(b"data: "):
                out.append(json.loads(line[6:]))
            elif line.startswith(b"error: "):
                raise EngineError(line[7:].decode("utf-8", errors="replace"))
        return out


def _field(fields: dict[Any, Any], name: str) -> str:
    raw = fields.get(name, fields.get(name.encode(), ""))
    return raw.decode() if isinstance(raw, bytes) else str(raw)


_NO_RETRY: weakref.WeakKeyDictionary[redis.ConnectionPool, redis.Redis] = (
    weakref.WeakKeyDictionary()
)
_NO_RETRY_LOCK = threading.Lock()


def no_retry_client(client: redis.Redis) -> redis.Redis:
    """A client on the same server, credentials and TLS as ``client`` (its own pool, made once
    per pool) whose commands are never re-sent by redis-py on a connection error. A re-sent
    MULTI/EXEC whose reply was lost would write its entries twice; a WATCH would prevent that
    too, at the price of a second round trip for every entry."""
    pool = client.connection_pool
    with _NO_RETRY_LOCK:
        got = _NO_RETRY.get(pool)
        if got is None:
            kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
            own = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
            got = _NO_RETRY[pool] = redis.Redis(connection_pool=own)
        return got


class DirectStreamWriter(StreamWriter):
    """The same stream, written on the caller's thread: for a relay (the llama-server primary),
    whose generation runs in another process and never waits on this thread, so a handoff to a
    writer thread would only add a thread wake-up per token on cores the engine needs."""

    def __init__(
        self, client: redis.Redis, job_id: str, cancel: threading.Event, **kw: Any
    ) -> None:
        super().__init__(client, job_id, cancel, start=False, **kw)

    def chunk(
        self,
        text: str,
        ids: list[int] | None = None,
        probs: list[dict[str, Any]] | None = None,
        lens: list[int] | None = None,
    ) -> None:
        if text or ids:
            e = entry(
                self._next(), "chunk", text, ids=ids, attempt=self.attempt, probs=probs, lens=lens
            )
            self._write([e])

    def done(self, finish_reason: str, usage: StreamUsage) -> None:
        self._write([entry(self._next(), "done", "", finish_reason, usage, attempt=self.attempt)])

    def fail(self, message: str, usage: StreamUsage | None = None, *, code: str = "") -> None:
        self._write(
            [entry(self._next(), "error", message, "error", usage, attempt=self.attempt, code=code)]
        )

    def close(self, timeout: float | None = None) -> None:
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
