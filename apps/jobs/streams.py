"""Following a job's token stream (docs/design/serving.md, "The stream protocol").

The follower yields entries in ``seq`` order and raises StreamFailure on a gap, an idle stream or
a dead primary. It counts what it relays itself: completion tokens are the sum of ``n`` over the
chunks it yielded (1 for a chunk without ``n``, from an agent that predates the field), and the
agent's ``usage`` is only compared against that count. Prompt tokens are the agent's figure,
bounded by the prompt's UTF-8 bytes plus the chat template's few tokens: a token is at least one
byte. While it reads it renews the job's slot lease (apps/jobs/admission.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from agent.protocol import job_cancel_key, job_stream_key
from apps.nodes.states import LOST
from racon import ids
from racon.ids import DeploymentId, JobId, NodeId
from racon.redis import CONNECTION_ERRORS, get_async_redis, get_redis

from . import admission, retention
from .models import Deployment, Job, JobAttempt
from .states import DEPLOYMENT_ENDED, JOB_TERMINAL

log = logging.getLogger("racon.jobs.streams")

# Tokens a chat template may add around the text: a default system prompt, the generation prompt,
# and per message the role and its markers. Generous on purpose: the bound is against a node
# inflating its count, not a precise figure.
CHAT_TEMPLATE_TOKENS = 64
CHAT_MESSAGE_TOKENS = 8
COMPLETION_TEMPLATE_TOKENS = 4  # BOS and the like
TOOLS_TEMPLATE_TOKENS = 256  # the words that introduce tools (agent/runtime/prompting.py)
# How long a cut job's cancel flag lives (apps/nodes/commands.py keeps its own the same).
CANCEL_FLAG_TTL_SECONDS = 3600
# Between a follower's reads while Redis is unreachable (past the client's own retries).
RECONNECT_PAUSE_SECONDS = 0.5


class StreamFailure(Exception):
    """The stream cannot deliver the job: ``code`` is the OpenAI-style error code shown to the client."""

    def __init__(
        self, message: str, *, code: str = "stream_error", during_execution: bool = True
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.during_execution = during_execution


def entry_tokens(fields: dict[str, str]) -> int:
    """Tokens a chunk entry carries: ``len(ids)``, never the node's own ``n`` (a claim). A chunk
    with text and no ids (an engine event with text alone) counts one, so text is never free."""
    ids = entry_ids(fields)
    if ids:
        return len(ids)
    return 1 if fields.get("text") else 0


def entry_lens(fields: dict[str, str], n: int) -> list[int]:
    """Each token's characters of a chunk's text (``lens``, written for coalesced chunks); when
    absent or not consistent with the text, the whole text is the last token's."""
    text = fields.get("text") or ""
    raw = fields.get("lens")
    if raw and n > 1:
        try:
            got = json.loads(raw)
        except ValueError:
            got = None
        if (
            isinstance(got, list)
            and len(got) == n
            and all(isinstance(x, int) and x >= 0 for x in got)
            and sum(got) == len(text)
        ):
            return got
    return [0] * (n - 1) + [len(text)] if n else []


def chunk_cut(fields: dict[str, str], ids: list[int], keep: int) -> dict[str, str]:
    """A chunk entry cut to its first ``keep`` tokens, on a token boundary (text by ``lens``)."""
    lens = entry_lens(fields, len(ids))
    out = dict(fields)
    out["ids"] = json.dumps(ids[:keep])
    out["text"] = (fields.get("text") or "")[: sum(lens[:keep])]
    out["lens"] = json.dumps(lens[:keep])
    out.pop("n", None)
    if fields.get("probs"):
        try:
            probs = json.loads(fields["probs"])
        except ValueError:
            probs = []
        out["probs"] = json.dumps(probs[:keep] if isinstance(probs, list) else [])
    return out


def chunks_merge(chunks: list[dict[str, str]]) -> dict[str, str]:
    """Chunk entries read together, as one (one SSE chunk for the client): text joined, ids and
    logprobs concatenated; the last one's seq and attempt."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    out = {
        "seq": last.get("seq", ""),
        "attempt": last.get("attempt", ""),
        "type": "chunk",
        "text": "".join(c.get("text") or "" for c in chunks),
        "ids": json.dumps([t for c in chunks for t in entry_ids(c)]),
    }
    if any(c.get("probs") for c in chunks):
        probs: list[Any] = []
        for c in chunks:
            try:
                got = json.loads(c.get("probs") or "[]")
            except ValueError:
                got = []
            probs += got if isinstance(got, list) else []
        out["probs"] = json.dumps(probs)
    return out


def entry_usage(fields: dict[str, str]) -> dict[str, Any]:
    """The agent's own usage figures of a done or error entry ({} when absent or malformed)."""
    try:
        got = json.loads(fields.get("usage") or "{}") or {}
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def error_for_entry(fields: dict[str, str]) -> StreamFailure:
    """The failure an error entry reports, told apart by its ``code``."""
    text = fields.get("text") or "generation failed"
    code = fields.get("code") or ""
    if not code:
        # An agent from before the `code` field: the one error that changes the answer (400, not
        # 502) is recognised by its message until every agent sends the code.
        low = text.lower()
        if "context" in low and ("exceed" in low or "too long" in low or "length" in low):
            code = "context_length_exceeded"
    if code == "context_length_exceeded":
        return StreamFailure(text, code=code, during_execution=False)
    return StreamFailure(text, code=code or "runtime_error")


# Why an attempt ended that another replica can make good (docs/design/serving.md, "Failover"):
# the agent's error entry when llama-server (or an RPC worker of its plan) died under the job, and
# the follower's own findings that the primary is gone or silent.
FAILOVER_CODES = frozenset(
    # node_paused: the owner paused lending with the failover handoff (agent/lending.py)
    {"primary_died", "primary_lost", "primary_timeout", "deployment_not_loaded", "node_paused"}
)


def failover_cause(*, code: str, text: str = "") -> str | None:
    """The failover cause of a failure or an error entry, or None when a retry would not help.

    Only the code decides (node protocol 2); ``text`` is kept for the callers' logs."""
    if code in FAILOVER_CODES:
        return code
    return None


def entry_ids(fields: dict[str, str]) -> list[int]:
    """The token ids a chunk entry carries ([] when absent or malformed)."""
    try:
        got = json.loads(fields.get("ids") or "[]")
    except ValueError:
        return []
    return [int(t) for t in got if isinstance(t, int)] if isinstance(got, list) else []


@dataclass(frozen=True)
class FailoverTarget:
    """Where a failed-over job goes on: the new attempt's deployment, primary and number.
    ``done``: nothing is left to generate (the old attempt produced max_tokens): end with length."""

    deployment_id: DeploymentId = DeploymentId("")
    node_id: NodeId = NodeId("")
    attempt: int = 0
    done: bool = False


# The reader's failover hook (apps/jobs/serving.py): given the follower (its counts and token ids
# so far) and the failure, move the job to another replica, or None to end it with the failure.
Failover = Callable[["StreamFollower", "StreamFailure"], Awaitable[FailoverTarget | None]]


def prompt_token_bound(*, kind: str, params: dict[str, Any]) -> int:
    """The most prompt tokens this request can have: its UTF-8 bytes plus the template's tokens."""
    if kind == "chat":
        messages = params.get("messages") or []
        tools = params.get("tools") or []
        # Tools and tool calls are in the prompt too (as JSON), with the words around them.
        extra = (
            TOOLS_TEMPLATE_TOKENS + len(json.dumps(tools, ensure_ascii=False).encode())
            if tools
            else 0
        )
        return (
            CHAT_TEMPLATE_TOKENS
            + extra
            + sum(
                len(str(m.get("content") or "").encode())
                + len(str(m.get("role") or "").encode())
                + (
                    len(json.dumps(m["tool_calls"], ensure_ascii=False).encode())
                    if m.get("tool_calls")
                    else 0
                )
                + CHAT_MESSAGE_TOKENS
                for m in messages
            )
        )
    return COMPLETION_TEMPLATE_TOKENS + len(str(params.get("prompt") or "").encode())


def billed_usage(
    *,
    completion_tokens: int,
    agent_usage: dict[str, Any],
    prompt_bound: int | None,
    job_id: JobId | None = None,
    check: bool = True,
) -> dict[str, Any]:
    """Usage to record and bill: the controller's completion count, the bounded prompt count.

    The agent's timings (ttft_ms, tokens_per_s) are kept. With ``check``, a completion count of
    the agent's far from ours is logged: a node's report is a claim.
    """
    out = dict(agent_usage)
    prompt = int(agent_usage.get("prompt_tokens") or 0)
    if prompt_bound is not None and prompt > prompt_bound:
        log.warning(
            "job %s: the node claims %d prompt tokens, more than the prompt's bound %d; billing %d",
            job_id,
            prompt,
            prompt_bound,
            prompt_bound,
        )
        prompt = prompt_bound
    claimed = agent_usage.get("completion_tokens")
    if check and claimed is not None:
        try:
            diff = abs(int(claimed) - completion_tokens)
        except (TypeError, ValueError):
            diff = 0
        if diff > max(2, completion_tokens // 10):
            log.warning(
                "job %s: the node reports %s completion tokens, the controller relayed %d",
                job_id,
                claimed,
                completion_tokens,
            )
    out["prompt_tokens"] = prompt
    out["completion_tokens"] = completion_tokens
    return out


def job_max_tokens(job_id: JobId) -> int | None:
    """The job's max_tokens (None for an id that names no job)."""
    try:
        pk = uuid.UUID(job_id)
    except ValueError:
        return None
    got = Job.objects.filter(pk=pk).values_list("max_tokens", flat=True).first()
    return int(got) if got is not None else None


class StreamFollower:
    """Reads one job's stream for the view; counts chunks and tokens as it yields them."""

    def __init__(
        self,
        *,
        job_id: JobId,
        deployment_id: DeploymentId | None,
        node_id: NodeId,
        prompt_bound: int | None = None,
        idle_timeout: float | None = None,
        failover: Failover | None = None,
        max_tokens: int | None = None,
        watch: bool = False,
    ) -> None:
        self.job_id = JobId(str(job_id))
        # A watcher (the job page) reads what the request's own reader relays: it renews no slot,
        # cuts nothing at max_tokens, and moves to the next attempt only once that reader made it.
        self.watch = watch
        # the primary that runs this attempt: the stream is under its prefix
        self.node_id = NodeId(str(node_id))
        self.deployment_id = DeploymentId(str(deployment_id)) if deployment_id else None
        self.prompt_bound = prompt_bound
        self.idle_timeout = float(
            settings.STREAM_IDLE_TIMEOUT_SECONDS if idle_timeout is None else idle_timeout
        )
        self.failover = failover
        self.chunks = 0  # over every attempt: what the client was sent
        self.completion_tokens = 0
        self.attempt = 1
        self.attempt_chunks = 0  # of the current attempt only (JobAttempt, settlement's split)
        self.attempt_tokens = 0
        self.ids: list[int] = []  # every token id relayed: a failover's resume_tokens
        self.failovers: list[dict[str, Any]] = []  # {from_node, to_node, attempt, tokens, gap_s}
        self.last_chunk_at: float | None = None  # monotonic time of the newest relayed chunk
        # The job's max_tokens (read from the job when not given): the stream ends there with
        # finish_reason "length", whatever the primary sends (it is cut on a token boundary).
        self.max_tokens = max_tokens
        self._max_tokens_known = max_tokens is not None
        self.cut = False  # the primary streamed past max_tokens: cut, and its job cancelled

    def usage(self, entry: dict[str, str] | None = None, *, check: bool = True) -> dict[str, Any]:
        """What to record for the job so far (``entry``: the final done or error entry, if any)."""
        return billed_usage(
            completion_tokens=self.completion_tokens,
            agent_usage=entry_usage(entry or {}),
            prompt_bound=self.prompt_bound,
            job_id=self.job_id,
            check=check,
        )

    async def entries(self) -> AsyncIterator[dict[str, str]]:
        """The job's entries in order, ending after ``done`` or ``error``; StreamFailure otherwise.

        With a ``failover`` hook, an attempt that ends because its primary died, vanished or went
        silent is not the end: the hook starts the next attempt on another replica (resuming
        from the token ids relayed so far) and the entries go on from that attempt's stream,
        so the reader sees one stream with every token once. Only when the hook gives up does
        the failure (or the error entry) reach the reader.

        Chunk entries read together are yielded as one (chunks_merge), so a client gets one SSE
        chunk for what arrived at once.
        """
        if not self._max_tokens_known and self.deployment_id and not self.watch:
            # A dispatched job (it has a deployment): its max_tokens, read once.
            self.max_tokens = await sync_to_async(job_max_tokens)(self.job_id)
        self._max_tokens_known = True
        while True:
            failure: StreamFailure | None = None
            error_entry: dict[str, str] | None = None
            try:
                async for fields in self._attempt_entries():
                    if (
                        fields.get("type") == "error"
                        and self.failover is not None
                        and failover_cause(
                            code=fields.get("code") or "", text=fields.get("text") or ""
                        )
                    ):
                        error_entry = fields
                        break
                    yield fields
                    if fields.get("type") in ("done", "error"):
                        return
            except StreamFailure as exc:
                if self.failover is None or failover_cause(code=exc.code) is None:
                    raise
                failure = exc
            if failure is None and error_entry is None:
                return
            if failure is None:
                assert error_entry is not None
                failure = StreamFailure(
                    error_entry.get("text") or "the primary died",
                    code=failover_cause(
                        code=error_entry.get("code") or "", text=error_entry.get("text") or ""
                    )
                    or "primary_died",
                )
            assert self.failover is not None
            target = await self.failover(self, failure)
            if target is None:
                if error_entry is not None:
                    yield error_entry  # the reader records and shows the engine's own error
                    return
                raise failure
            if target.done:
                yield {
                    "seq": "0",
                    "attempt": str(self.attempt),
                    "type": "done",
                    "finish_reason": "length",
                    "usage": "",
                }
                return
            self.failovers.append(
                {
                    "from_node": self.node_id,
                    "to_node": target.node_id,
                    "attempt": target.attempt,
                    "tokens": self.completion_tokens,
                    "cause": failure.code,
                }
            )
            self.node_id, self.deployment_id, self.attempt = (
                target.node_id,
                target.deployment_id,
                target.attempt,
            )
            self.attempt_chunks = self.attempt_tokens = 0

    async def _attempt_entries(self) -> AsyncIterator[dict[str, str]]:
        """The current attempt's entries, from its primary's stream, counted as relayed."""
        r = get_async_redis()
        key = job_stream_key(self.job_id, self.node_id)
        if self.watch and not await r.exists(key):
            # Released from the node's prefix at the job's end: replay the controller's copy.
            archived = retention.stream_archive_key(key)
            key = archived if await r.exists(archived) else key
        last_id = "0-0"
        expected = 0
        idle_since = renewed = time.monotonic()
        lost_since: float | None = None  # Redis unreachable since then (monotonic)
        while True:
            try:
                got = await r.xread({key: last_id}, block=1000, count=256)
                now_m = time.monotonic()
                if (
                    self.deployment_id
                    and not self.watch
                    and now_m - renewed >= admission.SLOT_RENEW_SECONDS
                ):
                    renewed = now_m
                    await admission.aslot_renew(
                        deployment_id=self.deployment_id, job_id=self.job_id
                    )
                gone = not got and await self._primary_gone()
            except CONNECTION_ERRORS as exc:
                # Redis restarting: the client has retried already; go on retrying (the stream
                # is kept, appendonly) until the idle bound, then end as a silent primary would.
                now_m = time.monotonic()
                lost_since = now_m if lost_since is None else lost_since
                if now_m - lost_since > self.idle_timeout:
                    raise StreamFailure(
                        f"lost the connection to Redis for {self.idle_timeout:.0f}s: {exc}",
                        code="stream_error",
                    ) from exc
                log.warning("job %s: Redis connection lost (%s); reconnecting", self.job_id, exc)
                await asyncio.sleep(RECONNECT_PAUSE_SECONDS)
                continue
            if lost_since is not None:
                log.info("job %s: Redis connection back; following on", self.job_id)
                lost_since = None
                idle_since = now_m  # the primary's silence is counted from the reconnect
            if not got:
                if now_m - idle_since > self.idle_timeout:
                    raise StreamFailure(
                        f"no output from the primary for {self.idle_timeout:.0f}s",
                        code="primary_timeout",
                    )
                if gone:
                    raise StreamFailure(
                        "the primary node of this deployment stopped responding",
                        code="primary_lost",
                    )
                continue
            idle_since = now_m
            pending: list[dict[str, str]] = []  # chunks read together: yielded as one
            for entry_id, fields in got[0][1]:
                last_id = entry_id
                try:
                    seq = int(fields.get("seq", -1))
                    attempt = int(fields.get("attempt") or self.attempt)
                except ValueError:
                    seq, attempt = -1, self.attempt
                if attempt < self.attempt:
                    continue  # a superseded attempt's late entry (two attempts on one node share the key)
                if pending and (attempt != self.attempt or seq != expected):
                    yield chunks_merge(pending)  # what was relayed before the change
                    pending = []
                if attempt > self.attempt and seq == 0:
                    # A later attempt in the same key: it starts over.
                    self.attempt, expected = attempt, 0
                    self.attempt_chunks = self.attempt_tokens = 0
                if seq != expected:
                    raise StreamFailure(
                        f"token stream gap: expected chunk {expected}, got {seq}", code="stream_gap"
                    )
                expected += 1
                etype = fields.get("type")
                if etype == "chunk":
                    ids = entry_ids(fields)
                    n = len(ids) if ids else (1 if fields.get("text") else 0)
                    over = self.max_tokens is not None and (
                        self.completion_tokens + n > self.max_tokens
                    )
                    if over:
                        # Past max_tokens: keep what fits, on a token boundary, and end here.
                        keep = max(0, int(self.max_tokens or 0) - self.completion_tokens)
                        fields = chunk_cut(fields, ids, keep)
                        ids, n = ids[:keep], keep
                    if n or fields.get("text"):
                        self.chunks += 1
                        self.completion_tokens += n
                        self.attempt_chunks += 1
                        self.attempt_tokens += n
                        self.ids.extend(ids)
                        self.last_chunk_at = now_m
                        pending.append(fields)
                    if over:
                        if pending:
                            yield chunks_merge(pending)
                        yield await self._cut_end(expected)
                        return
                    continue
                if pending:
                    yield chunks_merge(pending)
                    pending = []
                if (
                    etype == "done"
                    and self.max_tokens is not None
                    and self.completion_tokens >= self.max_tokens
                    and fields.get("finish_reason") != "cancelled"
                ):
                    fields = {**fields, "finish_reason": "length"}
                yield fields
                if etype in ("done", "error"):
                    return
            if pending:
                yield chunks_merge(pending)

    async def _cut_end(self, seq: int) -> dict[str, str]:
        """The end of a stream cut at max_tokens: a done entry of our own, finish_reason
        "length", and the primary asked to stop (its job's cancel flag)."""
        self.cut = True
        log.warning(
            "job %s: node %s streamed past max_tokens (%s); the stream is cut there",
            self.job_id,
            self.node_id,
            self.max_tokens,
        )
        try:
            await get_async_redis().set(
                job_cancel_key(self.job_id, self.node_id), 1, ex=CANCEL_FLAG_TTL_SECONDS
            )
        except CONNECTION_ERRORS as exc:
            log.warning("job %s: cannot flag the cut job cancelled: %s", self.job_id, exc)
        return {
            "seq": str(seq),
            "attempt": str(self.attempt),
            "type": "done",
            "text": "",
            "finish_reason": "length",
            "usage": "",
        }

    async def _primary_gone(self) -> bool:
        if self.watch and await sync_to_async(job_attempt_after)(self.job_id, self.attempt):
            return True  # the request's reader has moved on: this attempt's stream is over
        dep_id = self.deployment_id
        if not dep_id:
            return False
        dep = await sync_to_async(
            lambda: Deployment.objects.filter(pk=dep_id).values("state", "primary_id").first()
        )()
        if dep is None or dep["state"] in DEPLOYMENT_ENDED:
            return True
        state = await get_async_redis().hget(f"racon:node:{dep['primary_id']}:meta", "state")
        return state in LOST


def stream_tally(job_id: JobId, node_id: NodeId, *, attempt: int | None = None) -> tuple[int, int]:
    """(chunks, tokens) in a job's stream as it stands, counted the follower's way (for sweeps);
    with ``attempt``, that attempt's entries only (two attempts on one node share the key)."""
    chunks = tokens = 0
    for _, fields in get_redis().xrange(job_stream_key(JobId(str(job_id)), NodeId(str(node_id)))):
        if attempt is not None and (fields.get("attempt") or "1") != str(attempt):
            continue
        if fields.get("type") == "chunk":
            chunks += 1
            tokens += entry_tokens(fields)
    return chunks, tokens


# --- the job page's watcher ------------------------------------------------------------------------


def job_attempt_after(job_id: JobId, attempt: int) -> FailoverTarget | None:
    """The job's first attempt after ``attempt`` (its deployment, primary and number), if any."""
    row = (
        JobAttempt.objects.filter(job_id=job_id, number__gt=attempt)
        .order_by("number")
        .values("deployment_id", "primary_id", "number")
        .first()
    )
    if row is None or not row["primary_id"]:
        return None
    return FailoverTarget(
        deployment_id=(
            ids.deployment_id(row["deployment_id"]) if row["deployment_id"] else DeploymentId("")
        ),
        node_id=ids.node_id(row["primary_id"]),
        attempt=int(row["number"]),
    )


def job_watch_start(job_id: JobId) -> FailoverTarget | None:
    """Where a job's stream begins: its first attempt's primary when it failed over (the replay
    starts there), else its deployment's primary; None before dispatch."""
    first = job_attempt_after(job_id, 0)
    if first is not None:
        return first
    row = Job.objects.filter(pk=job_id).values("deployment_id", "deployment__primary_id").first()
    if row is None or not row["deployment__primary_id"]:
        return None
    return FailoverTarget(
        deployment_id=ids.deployment_id(row["deployment_id"]),
        node_id=ids.node_id(row["deployment__primary_id"]),
        attempt=1,
    )


def _job_ended(job_id: JobId) -> bool:
    return Job.objects.filter(pk=job_id, state__in=JOB_TERMINAL).exists()


async def _watch_next_attempt(
    follower: StreamFollower, failure: StreamFailure
) -> FailoverTarget | None:
    """The watcher's failover hook: the attempt the request's own reader started next, waited
    for up to the idle bound; None once the job ended without one (the failure is the end)."""
    deadline = time.monotonic() + follower.idle_timeout
    while time.monotonic() < deadline:
        nxt = await sync_to_async(job_attempt_after)(follower.job_id, follower.attempt)
        if nxt is not None:
            return nxt
        if await sync_to_async(_job_ended)(follower.job_id):
            return await sync_to_async(job_attempt_after)(follower.job_id, follower.attempt)
        await asyncio.sleep(WATCH_POLL_SECONDS)
    return None


WATCH_POLL_SECONDS = 0.5


async def job_watch(job_id: JobId) -> AsyncIterator[dict[str, str]]:
    """A job's entries from its first token to its end, across failovers, for a reader that only
    watches (the job page): the same follower as /v1's, moving to each next attempt as the
    request's reader makes it. Ends after ``done`` or ``error``, or quietly when the stream is
    gone (expired, or the job never ran)."""
    start = await sync_to_async(job_watch_start)(job_id)
    if start is None:
        return
    follower = StreamFollower(
        job_id=job_id,
        deployment_id=start.deployment_id or None,
        node_id=start.node_id,
        failover=_watch_next_attempt,
        watch=True,
    )
    follower.attempt = start.attempt
    # A follower like the /v1 relay (apps/jobs/retention.py): the job's streams stay while the page
    # reads them, and go when the job is terminal and no one follows.
    token = await sync_to_async(retention.stream_follow_begin)(job_id=job_id)
    try:
        async for fields in follower.entries():
            yield fields
    except StreamFailure as exc:
        log.info("job %s: the page's stream ended: %s", job_id, exc)
    finally:
        await sync_to_async(retention.stream_follow_end)(job_id=job_id, token=token)
