"""The /v1 views: /v1/chat/completions, /v1/completions, /v1/models.

Each request: authenticate and validate (serializers), admit through apps.jobs.serving (the
credit hold and the account's standing are computed here and passed in: jobs never imports
credits), read the job's stream, and shape OpenAI's answer (responses). The sync front is one
thread hop; the stream read is async.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from apps.accounts.models import Account, ApiKey
from apps.credits.ledger import InsufficientCredits
from apps.credits.rules import token_cost
from apps.credits.selectors import account_standing
from apps.credits.settlement import credit_reserve
from apps.jobs import admission, serving
from apps.jobs.jobs import job_mark_running
from apps.jobs.models import Job
from apps.jobs.serving import Admission, pooled
from apps.jobs.streams import StreamFailure, error_for_entry
from apps.models_repo.models import Model
from racon import ids
from racon.ids import AccountId, JobId, ModelId
from racon.logging import log_context

from .. import quotas
from ..auth import KeyPrincipal, bearer_from_header, principal_for_key
from ..errors import ApiError
from . import responses as shape
from .agentic import Shaping, ToolCallSplitter, split_content
from .serializers import (
    ChatCompletionIn,
    CompletionIn,
    agentic,
    max_tokens_asked,
    sampling,
    validate,
)

log = logging.getLogger("racon.api")


# --- the synchronous front (one thread hop) -------------------------------------------------------


def _principal(header: str) -> KeyPrincipal:
    raw = bearer_from_header(header)
    if not raw:
        raise ApiError(
            "You didn't provide an API key. Provide it as 'Authorization: Bearer YOUR_KEY'.",
            status_code=401,
            type_="invalid_request_error",
            code="invalid_api_key",
        )
    principal = principal_for_key(raw)
    if principal is None:
        raise ApiError(
            "Incorrect API key provided.",
            status_code=401,
            type_="invalid_request_error",
            code="invalid_api_key",
        )
    if ApiKey.SCOPE_INFERENCE not in principal.scopes:
        raise ApiError(
            "This API key lacks the 'inference' scope.",
            status_code=403,
            type_="permission_error",
            code="insufficient_scope",
        )
    return principal


def _credit_hold(job: Job, prompt_tokens: int) -> None:
    """Hold the job's worst case (its prompt's bound and max_tokens) on its account, in the job's
    own transaction (none without one)."""
    if job.account_id is not None:
        credit_reserve(
            account_id=ids.account_id(job.account_id),
            job_id=ids.job_id(job.id),
            max_tokens=job.max_tokens,
            prompt_tokens=prompt_tokens,
            model_price_permille=job.model.price_weight_permille,
            now=job.queued_at,
        )


def _gate(principal: KeyPrincipal) -> serving.Gate:
    """What must pass before the prompt leaves the controller: the account's balance covers the
    request's hold (a key without credits never pushes its prompt to a node), and the key's and
    the account's limits have room (apps.api.quotas). Returns the quota's release."""

    def gate(job_id: JobId, model: Model, prompt_tokens: int, max_tokens: int) -> Any:
        if principal.account_id is not None:
            funds_check(
                account_id=principal.account_id,
                tokens=prompt_tokens + max_tokens,
                price_permille=model.price_weight_permille,
            )
        return quotas.quota_take(
            principal=principal, job_id=job_id, tokens=prompt_tokens + max_tokens
        )

    return gate


def funds_check(*, account_id: AccountId, tokens: int, price_permille: int) -> None:
    """InsufficientCredits when the account cannot cover ``tokens`` at the model's price (the
    hold itself is taken, under the account's lock, when the job is written)."""
    cost = token_cost(
        tokens=tokens,
        price_permille=price_permille,
        micro_per_token=settings.CREDITS_MICRO_PER_TOKEN,
    )
    row = Account.objects.filter(pk=account_id).values("balance", "floor").first()
    if cost <= 0 or row is None or row["floor"] is None:
        return
    available = int(row["balance"]) - int(row["floor"])
    if available < cost:
        raise InsufficientCredits(account_id=account_id, needed=cost, available=available)


def _standing(account_id: AccountId | None) -> float:
    """The account's standing, read by admission only if the request has to queue."""
    if account_id is None:
        return 0.0
    return float(account_standing(account_ids=[account_id]).get(account_id, 0))


def _authorize_and_admit(
    *, header: str, kind: str, body: Any, request_id: str
) -> tuple[dict[str, Any], Admission]:
    """Authenticate, validate, admit. Authentication comes first, as with OpenAI: a bad key is 401
    whatever the body."""
    principal = _principal(header)
    v = validate(ChatCompletionIn if kind == "chat" else CompletionIn, body)
    params = sampling(v)
    if kind == "chat":
        params["messages"] = v["messages"]
    else:
        params["prompt"] = v["prompt"]
    params.update(agentic(v, kind=kind))
    try:
        adm = serving.admission_open(
            model_name=v["model"],
            account_id=principal.account_id,
            api_key_id=principal.key_id,
            kind=kind,
            params=params,
            max_tokens=max_tokens_asked(v),
            stream=bool(v.get("stream")),
            request_id=request_id,
            hold=_credit_hold,
            now=timezone.now(),
            gate=_gate(principal),
        )
    except serving.ModelNotFound as exc:
        raise ApiError(
            f"The model '{exc.name}' does not exist",
            status_code=404,
            param="model",
            code="model_not_found",
            type_="invalid_request_error",
        ) from exc
    except serving.ContextTooLong as exc:
        raise ApiError(
            f"max_tokens is too large: {exc.max_tokens}. "
            f"This model's context length is {exc.n_ctx} tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        ) from exc
    except InsufficientCredits as exc:
        raise ApiError(
            f"You exceeded your current quota: {exc}",
            status_code=429,
            type_="insufficient_quota",
            code="insufficient_quota",
        ) from exc
    except quotas.QuotaExceeded as exc:
        raise ApiError(
            str(exc),
            status_code=429,
            type_=exc.type,
            code=exc.code,
            headers={"Retry-After": str(exc.retry_after)},
        ) from exc
    return v, adm


async def _wait_and_dispatch(adm: Admission) -> None:
    """Wait (bounded) for a serving deployment and a slot, then dispatch; else 503 with Retry-After."""
    try:
        await serving.admission_wait(adm=adm, standing=lambda: _standing(adm.account_id))
    except admission.DeploymentUnavailable as exc:
        raise _no_capacity(
            f"No deployment of this model is available: {exc.reason}", retry_after=30
        ) from exc
    except admission.QueueFull as exc:
        raise _no_capacity("The server is at capacity; retry shortly.", retry_after=2) from exc
    except admission.WaitTimedOut as exc:
        raise _no_capacity(
            "The model is busy or still loading; retry shortly.", retry_after=5
        ) from exc


def _no_capacity(message: str, *, retry_after: int) -> ApiError:
    return ApiError(
        message,
        status_code=503,
        type_="server_error",
        code="no_capacity",
        headers={"Retry-After": str(retry_after)},
    )


def _stream_error(exc: StreamFailure) -> ApiError:
    """A failure before the answer began: context too long is the client's (400), else 502."""
    if exc.code == "context_length_exceeded":
        return ApiError(exc.message, param="messages", code="context_length_exceeded")
    if exc.code == "invalid_request":
        # The engine refused the request itself (a JSON schema it cannot turn into a grammar).
        return ApiError(exc.message, code="invalid_request")
    return ApiError(exc.message, status_code=502, type_="server_error", code=exc.code)


# --- the completion views -------------------------------------------------------------------------


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    return await _completion(request, kind="chat")


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponseBase:
    return await _completion(request, kind="completion")


async def _completion(request: HttpRequest, *, kind: str) -> HttpResponseBase:
    if request.method != "POST":
        return ApiError(
            "Use POST for this endpoint.", status_code=405, code="method_not_allowed"
        ).response()
    request_id = getattr(request, "request_id", "")
    adm: Admission | None = None
    try:
        try:
            body = json.loads(request.body or b"")
        except ValueError as exc:
            raise ApiError(
                f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
            ) from exc
        header = request.headers.get("Authorization", "")
        v, adm = await pooled(_authorize_and_admit)(
            header=header, kind=kind, body=body, request_id=request_id
        )
        with log_context(job_id=adm.job_id, deployment_id=adm.deployment_id):
            if not adm.dispatched:
                await _wait_and_dispatch(adm)
            log.info("job dispatched to %s", ",".join(adm.nodes))
            stream = bool(v.get("stream"))
            include_usage = bool((v.get("stream_options") or {}).get("include_usage"))
            # Read the first entry before answering: an early error (context too long) is a 400.
            try:
                first, entries = await serving.stream_open(adm=adm)
            except StreamFailure as exc:
                raise _stream_error(exc) from exc
            first_at = timezone.now()
            shaping = Shaping.of(agentic(v, kind=kind))
            if stream:
                resp = StreamingHttpResponse(
                    _sse_body(adm, kind, first, entries, include_usage, first_at, shaping),
                    content_type="text/event-stream",
                )
                resp["Cache-Control"] = "no-cache"
                resp["X-Accel-Buffering"] = "no"
                adm.handed_off = True
                return shape.with_job_headers(resp, adm)
            await pooled(job_mark_running)(job_id=adm.job_id, now=first_at)
            return shape.with_job_headers(await _collect(adm, kind, first, entries, shaping), adm)
    except ApiError as exc:
        if adm is not None and exc.status_code >= 500 and not adm.finished:
            await pooled(serving.admission_finish)(
                adm=adm, outcome="failed", error=exc.message, during=False
            )
        error = exc.response()
        if adm is not None:
            shape.with_job_headers(error, adm)
        return error
    except asyncio.CancelledError:
        # The client went away before its response began (queued, dispatching, or before the
        # first token): the wait already left the queue; the job is cancelled, its slot freed.
        if adm is not None and not adm.handed_off:
            serving.admission_cancel(adm=adm)
        raise
    except Exception:
        log.exception("internal error in %s completion", kind)
        if adm is not None and not adm.finished:
            await pooled(serving.admission_finish)(
                adm=adm, outcome="failed", error="internal error", during=None
            )
        return ApiError(
            "The server had an error while processing your request.",
            status_code=500,
            type_="server_error",
            code="internal_error",
        ).response()


def _entry_probs(entry: dict[str, str]) -> list[dict[str, Any]]:
    """The per-token logprobs a chunk entry carries (protocol.StreamEntry ``probs``)."""
    try:
        got = json.loads(entry.get("probs") or "[]")
    except ValueError:
        return []
    return got if isinstance(got, list) else []


class _Relay:
    """Turns a stream's chunks into what a streamed answer sends, by the request's Shaping:
    text as it comes, text held while it may be a tool call (auto), or all held (forced)."""

    def __init__(self, adm: Admission, kind: str, created: int, inc: bool, s: Shaping) -> None:
        self.adm, self.kind, self.created, self.inc, self.s = adm, kind, created, inc, s
        self.splitter = ToolCallSplitter(s.names) if s.mode == "auto" else None
        self.held: list[str] = []  # forced: the whole output
        self.probs: list[dict[str, Any]] = []  # logprobs not yet sent
        self.offset = 0  # characters sent (legacy logprobs' text_offset)
        self.calls: list[dict[str, Any]] = []

    def _content(self, text: str) -> bytes:
        probs = self.probs if self.s.logprobs else None
        chunk = shape.content_chunk(
            self.adm, self.kind, self.created, text, self.inc, probs, self.offset
        )
        self.offset += len(text)
        self.probs = []
        return shape.sse(chunk)

    def chunk(self, entry: dict[str, str]) -> list[bytes]:
        text = entry.get("text", "")
        if self.s.logprobs:
            self.probs.extend(_entry_probs(entry))
        if self.s.mode == "forced":
            self.held.append(text)
            return []
        if self.splitter is not None:
            text = self.splitter.feed(text)
            if not text:
                return []
        return [self._content(text)]

    def end(self) -> list[bytes]:
        """What is still to send at the end; sets ``calls``."""
        out: list[bytes] = []
        if self.s.mode == "forced":
            content, self.calls = split_content(
                "".join(self.held), mode="forced", names=self.s.names, parallel=self.s.parallel
            )
            if not self.calls and content:
                out.append(self._content(content))
        elif self.splitter is not None:
            rest, calls = self.splitter.finish()
            self.calls = calls[: None if self.s.parallel else 1]
            if rest:
                out.append(self._content(rest))
        if self.calls:
            probs = self.probs if self.s.logprobs else None
            out.append(
                shape.sse(
                    shape.tool_calls_chunk(self.adm, self.created, self.calls, self.inc, probs)
                )
            )
        return out


async def _sse_body(
    adm: Admission,
    kind: str,
    first: dict[str, str],
    entries: AsyncIterator[dict[str, str]],
    include_usage: bool,
    first_at: datetime,
    shaping: Shaping,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    marked_running = False
    done: dict[str, str] | None = None
    finish = pooled(serving.admission_finish)
    relay = _Relay(adm, kind, created, include_usage, shaping)
    # What is ready at once goes to the client in one write (one ASGI message, one socket
    # write): the role chunk with the first token's, and the end's chunks with [DONE].
    head = (
        shape.sse(
            shape.chat_chunk(
                adm, created, {"role": "assistant", "content": ""}, None, None, include_usage
            )
        )
        if kind == "chat"
        else b""
    )
    try:
        entry: dict[str, str] | None = first
        while entry is not None:
            etype = entry.get("type")
            out = b"".join(relay.chunk(entry)) if etype == "chunk" else b""
            if head or out:
                yield head + out
                head = b""
            if etype == "chunk":
                if not marked_running:
                    # Recorded after the first token is on the wire, not in front of it.
                    marked_running = True
                    await pooled(job_mark_running)(job_id=adm.job_id, now=first_at)
            elif etype == "done":
                fr = entry.get("finish_reason") or "stop"
                if fr == "cancelled":
                    await finish(adm=adm, outcome="cancelled", entry=entry, error="cancelled")
                    yield shape.sse_error("The request was cancelled.", "cancelled")
                    yield shape.DONE
                    return
                tail = relay.end()
                shown = "tool_calls" if relay.calls else fr
                tail.append(shape.sse(shape.finish_chunk(adm, kind, created, shown, include_usage)))
                if include_usage:
                    usage = shape.usage_body(
                        serving.admission_usage(adm=adm, entry=entry, check=False)
                    )
                    tail.append(shape.sse(shape.usage_chunk(adm, kind, created, usage)))
                # The client has everything: send [DONE] first, then record the job (settlement
                # and metrics) before the response closes, so a client that reads to the end
                # still finds the job COMPLETED. One that leaves at [DONE] is recorded below.
                done = entry
                yield b"".join([*tail, shape.DONE])
                await finish(adm=adm, outcome="completed", entry=entry, finish_reason=fr)
                return
            elif etype == "error":
                failure = error_for_entry(entry)
                await finish(
                    adm=adm, outcome="failed", entry=entry, error=failure.message, during=True
                )
                yield shape.sse_error(failure.message, failure.code)
                yield shape.DONE
                return
            try:
                entry = await entries.__anext__()
            except StopAsyncIteration:
                entry = None
    except StreamFailure as exc:
        await finish(adm=adm, outcome="failed", error=exc.message, during=True)
        yield shape.sse_error(exc.message, exc.code)
        yield shape.DONE
    finally:
        if done is not None:
            serving.admission_finish_in_background(
                adm=adm,
                outcome="completed",
                entry=done,
                finish_reason=done.get("finish_reason") or "stop",
            )
        serving.admission_cancel(adm=adm)  # both no-ops once the job's end was recorded


async def _collect(
    adm: Admission,
    kind: str,
    first: dict[str, str],
    entries: AsyncIterator[dict[str, str]],
    shaping: Shaping,
) -> HttpResponse:
    parts: list[str] = []
    probs: list[dict[str, Any]] = []
    entry: dict[str, str] | None = first
    finish = pooled(serving.admission_finish)
    try:
        while entry is not None:
            etype = entry.get("type")
            if etype == "chunk":
                parts.append(entry.get("text", ""))
                if shaping.logprobs:
                    probs.extend(_entry_probs(entry))
            elif etype == "done":
                fr = entry.get("finish_reason") or "stop"
                if fr == "cancelled":
                    await finish(adm=adm, outcome="cancelled", entry=entry, error="cancelled")
                    raise ApiError(
                        "The request was cancelled.",
                        status_code=499,
                        type_="server_error",
                        code="cancelled",
                    )
                usage = shape.usage_body(serving.admission_usage(adm=adm, entry=entry, check=False))
                await finish(adm=adm, outcome="completed", entry=entry, finish_reason=fr)
                content, calls = split_content(
                    "".join(parts),
                    mode=shaping.mode,
                    names=shaping.names,
                    parallel=shaping.parallel,
                )
                return JsonResponse(
                    shape.completion_body(
                        adm,
                        kind,
                        int(time.time()),
                        content,
                        "tool_calls" if calls else fr,
                        usage,
                        tool_calls=calls,
                        probs=probs if shaping.logprobs else None,
                    )
                )
            elif etype == "error":
                failure = error_for_entry(entry)
                await finish(
                    adm=adm, outcome="failed", entry=entry, error=failure.message, during=True
                )
                raise ApiError(
                    failure.message, status_code=502, type_="server_error", code=failure.code
                )
            entry = await entries.__anext__()
    except StreamFailure as exc:
        await finish(adm=adm, outcome="failed", error=exc.message, during=True)
        raise ApiError(exc.message, status_code=502, type_="server_error", code=exc.code) from exc
    except (asyncio.CancelledError, GeneratorExit):
        serving.admission_cancel(adm=adm)
        raise
    raise StreamFailure("the stream ended without a final entry")


# --- /v1/embeddings -------------------------------------------------------------------------------


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    """Always a 400 that says why: deployments run llama-server for generation, without
    ``--embeddings`` (a pooled model needs its own deployment kind)."""
    try:
        await sync_to_async(_principal)(request.headers.get("Authorization", ""))
    except ApiError as exc:
        return exc.response()
    try:
        model = json.loads(request.body or b"{}").get("model")
    except (ValueError, AttributeError):
        model = None
    return ApiError(
        f"Embeddings are not supported: RACoN serves {'the model ' + repr(model) if model else 'its models'} "
        "for chat and text completion only (llama-server runs without --embeddings).",
        param="model",
        code="embeddings_not_supported",
    ).response()


# --- /v1/models -----------------------------------------------------------------------------------


def _models_payload(model_id: ModelId | None = None) -> dict[str, Any] | None:
    qs = Model.objects.filter(files__isnull=False).distinct()
    if model_id is not None:
        qs = qs.filter(name=model_id)
    models = list(qs)
    if model_id is not None:
        return shape.model_body(models[0]) if models else None
    return shape.models_body(models)


@csrf_exempt
async def models_list(request: HttpRequest) -> HttpResponse:
    try:
        await sync_to_async(_principal)(request.headers.get("Authorization", ""))
    except ApiError as exc:
        return exc.response()
    return JsonResponse(await sync_to_async(_models_payload)())


@csrf_exempt
async def model_detail(request: HttpRequest, model_id: ModelId) -> HttpResponse:
    try:
        await sync_to_async(_principal)(request.headers.get("Authorization", ""))
    except ApiError as exc:
        return exc.response()
    body = await sync_to_async(_models_payload)(model_id)
    if body is None:
        return ApiError(
            f"The model '{model_id}' does not exist",
            status_code=404,
            param="model",
            code="model_not_found",
        ).response()
    return JsonResponse(body)
