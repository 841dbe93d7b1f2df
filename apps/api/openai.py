"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

A request's path (DESIGN.md): validate, authenticate, reserve credits and create the job, route to
a READY deployment (or place one and wait, bounded), take a slot, push run_job onto the primary's
queue, then read the job's Redis stream and write SSE. Every hop is latency: the sync part is one
thread hop, the stream read is async. Slots and the queue are apps/jobs/admission.py's, the stream
reading and token counts apps/jobs/streams.py's; this module validates, calls them and shapes
OpenAI's responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers

from agent.protocol import job_cancel_key
from apps.credits.services import InsufficientCredits, account_standing
from apps.jobs import admission
from apps.jobs import selectors as job_selectors
from apps.jobs import services as job_services
from apps.jobs import streams as job_streams
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.jobs.streams import StreamFailure
from apps.models_repo.models import Model
from racon import cache
from racon.logging import log_context
from racon.redis import get_redis

from .auth import ApiKey, KeyPrincipal, bearer_from_header, principal_for_key
from .errors import ApiError

log = logging.getLogger("racon.api")


def db(fn: Any) -> Any:
    """Run a request's synchronous step on the shared thread pool, not the single thread
    sync_to_async uses by default: with 8-16 streams, admission, first-token and finish steps of
    different requests would otherwise queue behind each other (measured in bench/concurrency.py:
    time to first token at 8 streams). Each pool thread keeps its own database connection."""
    return sync_to_async(fn, thread_sensitive=False)


# --- validation ---------------------------------------------------------------------------------


class _ContentPart(serializers.Serializer):
    type = serializers.ChoiceField(choices=["text"])
    text = serializers.CharField(allow_blank=True, trim_whitespace=False)


class _MessageField(serializers.Field):
    def to_internal_value(self, data: Any) -> dict[str, str]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("each message must be an object")
        role = data.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise serializers.ValidationError(f"role must be one of system, user, assistant; got {role!r}")
        content = data.get("content")
        if isinstance(content, list):
            parts = _ContentPart(data=content, many=True)
            if not parts.is_valid():
                raise serializers.ValidationError("content parts must be {'type': 'text', 'text': ...}")
            content = "".join(p["text"] for p in parts.validated_data)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise serializers.ValidationError("content must be a string or a list of text parts")
        return {"role": "system" if role == "developer" else role, "content": content}

    def to_representation(self, value: Any) -> Any:
        return value


class _StopField(serializers.Field):
    def to_internal_value(self, data: Any) -> list[str]:
        if data is None:
            return []
        if isinstance(data, str):
            return [data]
        if isinstance(data, list) and all(isinstance(s, str) for s in data) and len(data) <= 4:
            return data
        raise serializers.ValidationError("stop must be a string or a list of up to 4 strings")

    def to_representation(self, value: Any) -> Any:
        return value


class _StreamOptions(serializers.Serializer):
    include_usage = serializers.BooleanField(required=False, default=False)


class _CommonParams(serializers.Serializer):
    model = serializers.CharField(max_length=200)
    stream = serializers.BooleanField(required=False, default=False, allow_null=True)
    stream_options = _StreamOptions(required=False, allow_null=True)
    max_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1_000_000)
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=2)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    stop = _StopField(required=False, allow_null=True)
    seed = serializers.IntegerField(required=False, allow_null=True)
    presence_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2, max_value=2)
    frequency_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2, max_value=2)
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)

    def validate_n(self, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise serializers.ValidationError("n > 1 is not supported: RACoN returns one choice per request")
        return value


class ChatCompletionIn(_CommonParams):
    messages = serializers.ListField(child=_MessageField(), allow_empty=False, max_length=2048)
    max_completion_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1_000_000)


class CompletionIn(_CommonParams):
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)


def _first_error(errors: Any, prefix: str = "") -> tuple[str, str]:
    """(param, message) of the first validation error, param in OpenAI's dotted form."""
    if isinstance(errors, dict):
        for key, value in errors.items():
            name = f"{prefix}.{key}" if prefix and not str(key).isdigit() else (f"{prefix}[{key}]" if prefix else str(key))
            return _first_error(value, name)
    if isinstance(errors, list) and errors:
        for i, value in enumerate(errors):
            if value:
                if isinstance(value, dict | list) and not isinstance(value, str):
                    return _first_error(value, f"{prefix}[{i}]" if isinstance(value, dict) else prefix)
                return prefix, str(value)
    return prefix, str(errors)


def _validate(serializer_cls: type[serializers.Serializer], body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", param=None, code="invalid_request_body")
    s = serializer_cls(data=body)
    if not s.is_valid():
        param, message = _first_error(s.errors)
        top = param.split(".")[0].split("[")[0]
        if top == "messages" and "empty" in message.lower():
            message = "messages must contain at least one message"
        raise ApiError(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")
    return dict(s.validated_data)


def _sampling(v: dict[str, Any]) -> dict[str, Any]:
    return {
        "temperature": 1.0 if v.get("temperature") is None else float(v["temperature"]),
        "top_p": 1.0 if v.get("top_p") is None else float(v["top_p"]),
        "stop": v.get("stop") or [],
        "seed": v.get("seed"),
        "presence_penalty": float(v.get("presence_penalty") or 0.0),
        "frequency_penalty": float(v.get("frequency_penalty") or 0.0),
    }


# --- admission (one sync hop) ---------------------------------------------------------------------

MODEL_CACHE = "model"  # racon/cache.py: invalidated by Model and ModelFile writes (apps.py)


@dataclass
class Admission:
    job_id: str
    model_name: str
    model_id: Any = None
    deployment_id: str | None = None
    primary_id: str | None = None  # the node that runs it: its stream and cancel keys are under it
    dispatched: bool = False
    nodes: list[str] = field(default_factory=list)
    n_parallel: int = 1
    account_id: Any = None
    queued_ts: float = 0.0
    prompt_bound: int | None = None
    follower: job_streams.StreamFollower | None = None
    handed_off: bool = False  # the streaming body owns the job from here
    finished: bool = False  # a finish (or a cancel) was recorded


def _principal(header: str) -> KeyPrincipal:
    raw = bearer_from_header(header)
    if not raw:
        raise ApiError(
            "You didn't provide an API key. Provide it as 'Authorization: Bearer YOUR_KEY'.",
            status_code=401, type_="invalid_request_error", code="invalid_api_key",
        )
    principal = principal_for_key(raw)
    if principal is None:
        raise ApiError("Incorrect API key provided.", status_code=401, type_="invalid_request_error", code="invalid_api_key")
    if ApiKey.SCOPE_INFERENCE not in principal.scopes:
        raise ApiError("This API key lacks the 'inference' scope.", status_code=403, type_="permission_error", code="insufficient_scope")
    return principal


def _authorize_and_admit(*, header: str, kind: str, body: Any, request_id: str) -> tuple[dict[str, Any], Admission]:
    """One thread hop for the whole synchronous front of a request.

    Authentication comes before validation, as with OpenAI: a bad key is 401 whatever the body.
    """
    principal = _principal(header)
    v = _validate(ChatCompletionIn if kind == "chat" else CompletionIn, body)
    return v, _admit(principal=principal, kind=kind, v=v, request_id=request_id)


def _model_by_name(name: str) -> Model | None:
    """The servable model of this name (one with a file), through the process cache."""

    def load() -> Model | None:
        model = Model.objects.filter(name=name).first()
        return model if model is not None and model.files.exists() else None

    return cache.cached(MODEL_CACHE, name, load)


def _quota_error(exc: InsufficientCredits) -> ApiError:
    return ApiError(f"You exceeded your current quota: {exc}", status_code=429, type_="insufficient_quota", code="insufficient_quota")


def _admit(*, principal: KeyPrincipal, kind: str, v: dict[str, Any], request_id: str) -> Admission:
    """Find the model, reserve credits, create the job; dispatch at once when a slot is free."""
    model = _model_by_name(v["model"])
    if model is None:
        raise ApiError(f"The model '{v['model']}' does not exist", status_code=404, param="model", code="model_not_found", type_="invalid_request_error")
    max_tokens = int(v.get("max_completion_tokens") or v.get("max_tokens") or settings.DEFAULT_MAX_TOKENS)
    params = _sampling(v)
    if kind == "chat":
        params["messages"] = v["messages"]
    else:
        params["prompt"] = v["prompt"]
    now = timezone.now()
    deployment = job_selectors.deployment_route(model_id=model.id, cached=True)
    if deployment is not None and max_tokens > deployment.n_ctx:
        raise ApiError(
            f"max_tokens is too large: {max_tokens}. This model's context length is {deployment.n_ctx} tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    stream = bool(v.get("stream"))
    job_id = uuid.uuid4()
    adm = Admission(
        job_id=str(job_id), model_name=model.name, model_id=model.id, account_id=principal.account_id, queued_ts=now.timestamp(),
        prompt_bound=job_streams.prompt_token_bound(kind=kind, params=params),
    )
    fast = deployment if deployment is not None and deployment.state in (DeploymentState.READY, DeploymentState.DEGRADED) else None
    # Fast path: a free slot with nobody waiting. Push run_job first, then write the job row,
    # its credit hold and the dispatch in one transaction while the primary evaluates the prompt.
    # If the credits are short, the primary is told to cancel before any token reaches anyone.
    if fast is not None and admission.slot_try(deployment_id=fast.id, job_id=job_id, cap=fast.n_parallel):
        try:
            job_services.command_send(
                node_id=fast.primary_id, kind="run_job",
                payload=job_services.job_run_payload(job_id=job_id, deployment_id=fast.id, kind=kind, max_tokens=max_tokens, params=params),
            )
            job_services.job_create(
                model=model, account_id=principal.account_id, api_key_id=principal.key_id, kind=kind, params=params,
                max_tokens=max_tokens, stream=stream, request_id=request_id, now=now, job_id=job_id, dispatched_to=fast,
            )
        except BaseException as exc:
            get_redis().set(job_cancel_key(str(job_id), str(fast.primary_id)), 1, ex=3600)
            admission.slot_release(deployment_id=fast.id, job_id=job_id)
            if isinstance(exc, InsufficientCredits):
                raise _quota_error(exc) from exc
            raise
        adm.deployment_id, adm.dispatched, adm.n_parallel = str(fast.id), True, fast.n_parallel
        adm.primary_id = str(fast.primary_id)
        adm.nodes = [job_selectors.node_name(n) for n in job_services.dispatch_node_ids(fast)]
        return adm
    try:
        job_services.job_create(
            model=model, account_id=principal.account_id, api_key_id=principal.key_id, kind=kind, params=params,
            max_tokens=max_tokens, stream=stream, request_id=request_id, now=now, job_id=job_id,
        )
    except InsufficientCredits as exc:
        raise _quota_error(exc) from exc
    if deployment is None:
        deployment = job_services.deployment_ensure(model=model, now=now)
    adm.deployment_id = str(deployment.id)
    adm.n_parallel = deployment.n_parallel
    return adm


def _priority_score(account_id: Any, queued_ts: float) -> float:
    """Lower is served first: arrival time minus a standing bonus capped at the max wait (bounded starvation)."""
    standing = account_standing(account_ids=[account_id]).get(account_id, 0)
    bonus = min(float(settings.PRIORITY_MAX_WAIT_SECONDS), max(0.0, float(standing)) / 1_000_000.0)
    return queued_ts - bonus


async def _wait_and_dispatch(adm: Admission) -> None:
    """Wait (bounded) for a READY deployment and a slot, then dispatch; else 503 with Retry-After."""
    try:
        await admission.wait_for_slot(
            deployment_id=adm.deployment_id, job_id=adm.job_id, model_id=adm.model_id, queued_at=adm.queued_ts,
            priority=lambda: _priority_score(adm.account_id, adm.queued_ts),
            load_timeout=max(settings.DEPLOYMENT_WAIT_SECONDS, settings.JOB_QUEUE_WAIT_SECONDS), slot_timeout=settings.JOB_QUEUE_WAIT_SECONDS,
        )
    except admission.DeploymentUnavailable as exc:
        await db(_give_up)(adm, f"no deployment could serve the request: {exc.reason}")
        raise ApiError(f"No deployment of this model is available: {exc.reason}", status_code=503, type_="server_error", code="no_capacity", headers={"Retry-After": "30"}) from exc
    except admission.QueueFull as exc:
        await db(_give_up)(adm, "no capacity: queue full")
        raise ApiError("The server is at capacity; retry shortly.", status_code=503, type_="server_error", code="no_capacity", headers={"Retry-After": "2"}) from exc
    except admission.WaitTimedOut as exc:
        await db(_give_up)(adm, "timed out waiting for capacity")
        raise ApiError("The model is busy or still loading; retry shortly.", status_code=503, type_="server_error", code="no_capacity", headers={"Retry-After": "5"}) from exc
    await db(_dispatch)(adm)


def _dispatch(adm: Admission) -> None:
    """Push the job to the deployment whose slot it holds (job_dispatch gives the slot back on failure)."""
    try:
        deployment = Deployment.objects.get(pk=adm.deployment_id)
    except Deployment.DoesNotExist:
        admission.slot_release(deployment_id=adm.deployment_id, job_id=adm.job_id)
        raise
    out = job_services.job_dispatch(job_id=adm.job_id, deployment=deployment, now=timezone.now())
    adm.dispatched = True
    adm.n_parallel = deployment.n_parallel
    adm.primary_id = out["primary"]
    adm.nodes = [job_selectors.node_name(n) for n in out["nodes"]]


def _give_up(adm: Admission, reason: str) -> None:
    adm.finished = True
    job_services.job_fail(job_id=adm.job_id, now=timezone.now(), error=reason, during_execution=False)


# --- finishing --------------------------------------------------------------------------------


def _usage_of(adm: Admission, entry: dict[str, str] | None = None, *, check: bool = True) -> dict[str, Any]:
    return adm.follower.usage(entry, check=check) if adm.follower is not None else {}


def _finish_sync(adm: Admission, outcome: str, *, entry: dict[str, str] | None = None, finish_reason: str = "stop", error: str = "", during: bool | None = None) -> None:
    """Record the job's end with the controller's own counts (streams.StreamFollower)."""
    adm.finished = True
    now = timezone.now()
    chunks = adm.follower.chunks if adm.follower is not None else 0
    if outcome == "completed":
        job_services.job_complete(job_id=adm.job_id, usage=_usage_of(adm, entry), finish_reason=finish_reason, chunks=chunks, now=now)
    elif outcome == "cancelled":
        job_services.job_cancel(job_id=adm.job_id, now=now, reason=error or "client disconnected", usage=_usage_of(adm, entry, check=False), chunks=chunks)
    else:
        job_services.job_fail(job_id=adm.job_id, now=now, error=error, during_execution=during, usage=_usage_of(adm, entry, check=False), chunks=chunks)


def _finish_in_background(adm: Admission, outcome: str, **kw: Any) -> None:
    """Record the job's end off a task that is being cancelled (no await is safe there)."""
    if adm.finished:
        return
    adm.finished = True

    def run() -> None:
        try:
            _finish_sync(adm, outcome, **kw)
        finally:
            connections.close_all()  # this thread's own connection

    threading.Thread(target=run, daemon=True).start()


def _cancel_in_background(adm: Admission) -> None:
    """Client gone: flag the primary at once (Redis), record CANCELLED off the cancelled task."""
    if adm.finished:
        return
    try:
        if adm.primary_id:
            get_redis().set(job_cancel_key(adm.job_id, adm.primary_id), 1, ex=3600)
    except Exception:  # noqa: BLE001
        log.warning("could not set the cancel flag", exc_info=True)
    _finish_in_background(adm, "cancelled", error="client disconnected")


# --- response shapes --------------------------------------------------------------------------


def _chat_chunk(adm: Admission, created: int, delta: dict[str, Any], finish_reason: str | None, usage: Any = None, with_usage_field: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"chatcmpl-{adm.job_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": adm.model_name,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        body["usage"] = usage
    return body


def _text_chunk(adm: Admission, created: int, text: str, finish_reason: str | None, usage: Any = None, with_usage_field: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"cmpl-{adm.job_id}",
        "object": "text_completion",
        "created": created,
        "model": adm.model_name,
        "system_fingerprint": None,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        body["usage"] = usage
    return body


def _openai_usage(u: dict[str, Any]) -> dict[str, int]:
    p = int(u.get("prompt_tokens") or 0)
    c = int(u.get("completion_tokens") or 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _headers(resp: HttpResponse, adm: Admission) -> HttpResponse:
    resp["X-Racon-Job-Id"] = adm.job_id
    resp["X-Racon-Nodes"] = ",".join(adm.nodes)
    if adm.deployment_id:
        resp["X-Racon-Deployment-Id"] = adm.deployment_id
    return resp


# --- views ---------------------------------------------------------------------------------------


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _completion(request, kind="chat")


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _completion(request, kind="completion")


async def _completion(request: HttpRequest, *, kind: str) -> HttpResponse:
    if request.method != "POST":
        return ApiError("Use POST for this endpoint.", status_code=405, code="method_not_allowed").response()
    request_id = getattr(request, "request_id", "")
    adm: Admission | None = None
    try:
        try:
            body = json.loads(request.body or b"")
        except ValueError as exc:
            raise ApiError(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
        header = request.headers.get("Authorization", "")
        v, adm = await db(_authorize_and_admit)(header=header, kind=kind, body=body, request_id=request_id)
        with log_context(job_id=adm.job_id, deployment_id=adm.deployment_id):
            if not adm.dispatched:
                await _wait_and_dispatch(adm)
            log.info("job dispatched to %s", ",".join(adm.nodes))
            stream = bool(v.get("stream"))
            include_usage = bool((v.get("stream_options") or {}).get("include_usage"))
            adm.follower = job_streams.StreamFollower(
                job_id=adm.job_id, deployment_id=adm.deployment_id, node_id=adm.primary_id, prompt_bound=adm.prompt_bound
            )
            entries = adm.follower.entries()
            # Read the first entry before answering: an early error (context too long) is a 400.
            try:
                first = await entries.__anext__()
            except StreamFailure as exc:
                await db(_finish_sync)(adm, "failed", error=exc.message, during=True)
                raise ApiError(exc.message, status_code=502, type_="server_error", code=exc.code) from exc
            if first.get("type") == "error":
                failure = job_streams.error_for_entry(first)
                await db(_finish_sync)(adm, "failed", entry=first, error=failure.message, during=failure.during_execution)
                if failure.code == "context_length_exceeded":
                    raise ApiError(failure.message, param="messages", code="context_length_exceeded")
                raise ApiError(failure.message, status_code=502, type_="server_error", code=failure.code)
            first_at = timezone.now()
            if stream:
                resp = StreamingHttpResponse(_sse_body(adm, kind, first, entries, include_usage, first_at), content_type="text/event-stream")
                resp["Cache-Control"] = "no-cache"
                resp["X-Accel-Buffering"] = "no"
                adm.handed_off = True
                return _headers(resp, adm)
            await db(job_services.job_mark_running)(job_id=adm.job_id, now=first_at)
            return _headers(await _collect(adm, kind, first, entries), adm)
    except ApiError as exc:
        if adm is not None and exc.status_code >= 500 and not adm.finished:
            await db(_finish_sync)(adm, "failed", error=exc.message, during=False)
        resp = exc.response()
        if adm is not None:
            _headers(resp, adm)
        return resp
    except asyncio.CancelledError:
        # The client went away before its response began (queued, dispatching, or before the
        # first token): the wait already left the queue; the job is cancelled, its slot freed.
        if adm is not None and not adm.handed_off:
            _cancel_in_background(adm)
        raise
    except Exception:
        log.exception("internal error in %s completion", kind)
        if adm is not None and not adm.finished:
            await db(_finish_sync)(adm, "failed", error="internal error", during=None)
        return ApiError("The server had an error while processing your request.", status_code=500, type_="server_error", code="internal_error").response()


async def _sse_body(
    adm: Admission, kind: str, first: dict[str, str], entries: AsyncIterator[dict[str, str]], include_usage: bool, first_at: Any
) -> AsyncIterator[bytes]:
    created = int(time.time())
    marked_running = False
    done: dict[str, str] | None = None
    try:
        if kind == "chat":
            yield _sse(_chat_chunk(adm, created, {"role": "assistant", "content": ""}, None, None, include_usage))
        entry: dict[str, str] | None = first
        while entry is not None:
            etype = entry.get("type")
            if etype == "chunk":
                text = entry.get("text", "")
                if kind == "chat":
                    yield _sse(_chat_chunk(adm, created, {"content": text}, None, None, include_usage))
                else:
                    yield _sse(_text_chunk(adm, created, text, None, None, include_usage))
                if not marked_running:
                    # Recorded after the first token is on the wire, not in front of it.
                    marked_running = True
                    await db(job_services.job_mark_running)(job_id=adm.job_id, now=first_at)
            elif etype == "done":
                fr = entry.get("finish_reason") or "stop"
                if fr == "cancelled":
                    await db(_finish_sync)(adm, "cancelled", entry=entry, error="cancelled")
                    yield _sse({"error": {"message": "The request was cancelled.", "type": "server_error", "param": None, "code": "cancelled"}})
                    yield b"data: [DONE]\n\n"
                    return
                if kind == "chat":
                    yield _sse(_chat_chunk(adm, created, {}, fr, None, include_usage))
                else:
                    yield _sse(_text_chunk(adm, created, "", fr, None, include_usage))
                if include_usage:
                    final = (_chat_chunk if kind == "chat" else _text_chunk)(adm, created, {} if kind == "chat" else "", None, _openai_usage(_usage_of(adm, entry, check=False)), True)  # type: ignore[operator]
                    final["choices"] = []
                    yield _sse(final)
                # The client has everything: send [DONE] first, then record the job (settlement
                # and metrics) before the response closes, so a client that reads to the end
                # still finds the job COMPLETED. One that leaves at [DONE] is recorded below.
                done = entry
                yield b"data: [DONE]\n\n"
                await db(_finish_sync)(adm, "completed", entry=entry, finish_reason=fr)
                return
            elif etype == "error":
                failure = job_streams.error_for_entry(entry)
                await db(_finish_sync)(adm, "failed", entry=entry, error=failure.message, during=True)
                yield _sse({"error": {"message": failure.message, "type": "server_error", "param": None, "code": failure.code}})
                yield b"data: [DONE]\n\n"
                return
            try:
                entry = await entries.__anext__()
            except StopAsyncIteration:
                entry = None
    except StreamFailure as exc:
        await db(_finish_sync)(adm, "failed", error=exc.message, during=True)
        yield _sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield b"data: [DONE]\n\n"
    finally:
        if done is not None:
            _finish_in_background(adm, "completed", entry=done, finish_reason=done.get("finish_reason") or "stop")
        _cancel_in_background(adm)  # both no-ops once the job's end was recorded


async def _collect(adm: Admission, kind: str, first: dict[str, str], entries: AsyncIterator[dict[str, str]]) -> HttpResponse:
    parts: list[str] = []
    entry: dict[str, str] | None = first
    try:
        while entry is not None:
            etype = entry.get("type")
            if etype == "chunk":
                parts.append(entry.get("text", ""))
            elif etype == "done":
                fr = entry.get("finish_reason") or "stop"
                if fr == "cancelled":
                    await db(_finish_sync)(adm, "cancelled", entry=entry, error="cancelled")
                    raise ApiError("The request was cancelled.", status_code=499, type_="server_error", code="cancelled")
                usage = _openai_usage(_usage_of(adm, entry, check=False))
                await db(_finish_sync)(adm, "completed", entry=entry, finish_reason=fr)
                text = "".join(parts)
                created = int(time.time())
                if kind == "chat":
                    body = {
                        "id": f"chatcmpl-{adm.job_id}", "object": "chat.completion", "created": created, "model": adm.model_name,
                        "system_fingerprint": None,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None, "finish_reason": fr}],
                        "usage": usage,
                    }
                else:
                    body = {
                        "id": f"cmpl-{adm.job_id}", "object": "text_completion", "created": created, "model": adm.model_name,
                        "system_fingerprint": None,
                        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": fr}],
                        "usage": usage,
                    }
                return JsonResponse(body)
            elif etype == "error":
                failure = job_streams.error_for_entry(entry)
                await db(_finish_sync)(adm, "failed", entry=entry, error=failure.message, during=True)
                raise ApiError(failure.message, status_code=502, type_="server_error", code=failure.code)
            entry = await entries.__anext__()
    except StreamFailure as exc:
        await db(_finish_sync)(adm, "failed", error=exc.message, during=True)
        raise ApiError(exc.message, status_code=502, type_="server_error", code=exc.code) from exc
    except (asyncio.CancelledError, GeneratorExit):
        _cancel_in_background(adm)
        raise
    raise StreamFailure("the stream ended without a final entry")


# --- /v1/models -----------------------------------------------------------------------------------


def _models_payload(model_id: str | None = None) -> dict[str, Any] | None:
    qs = Model.objects.filter(files__isnull=False).distinct()
    if model_id is not None:
        qs = qs.filter(name=model_id)
    out = []
    for m in qs:
        out.append({"id": m.name, "object": "model", "created": int(m.created_at.timestamp()), "owned_by": "racon"})
    if model_id is not None:
        return out[0] if out else None
    return {"object": "list", "data": out}


@csrf_exempt
async def models_list(request: HttpRequest) -> HttpResponse:
    try:
        await sync_to_async(_principal)(request.headers.get("Authorization", ""))
    except ApiError as exc:
        return exc.response()
    return JsonResponse(await sync_to_async(_models_payload)())


@csrf_exempt
async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    try:
        await sync_to_async(_principal)(request.headers.get("Authorization", ""))
    except ApiError as exc:
        return exc.response()
    body = await sync_to_async(_models_payload)(model_id)
    if body is None:
        return ApiError(f"The model '{model_id}' does not exist", status_code=404, param="model", code="model_not_found").response()
    return JsonResponse(body)
