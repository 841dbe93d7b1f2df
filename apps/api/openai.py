"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

A request's path (DESIGN.md): validate, authenticate, reserve credits and create the job, route to
a READY deployment (or place one and wait, bounded), take a slot, push run_job onto the primary's
queue, then read the job's Redis stream and write SSE. Every hop is latency: the sync part is one
thread hop, the stream read is async.
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

from agent.protocol import job_cancel_key, job_stream_key
from apps.jobs import selectors as job_selectors
from apps.jobs import services as job_services
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from racon.logging import log_context
from racon.redis import get_async_redis, get_redis

from .auth import ApiKey, KeyPrincipal, bearer_from_header, principal_for_key
from .errors import ApiError

log = logging.getLogger("racon.api")

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

_SLOT_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) then return 0 end
local top = redis.call('ZRANGE', KEYS[2], 0, 0)
if top[1] and top[1] ~= ARGV[2] then return 0 end
redis.call('INCR', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""


@dataclass
class Admission:
    job_id: str
    model_name: str
    deployment_id: str | None = None
    dispatched: bool = False
    nodes: list[str] = field(default_factory=list)
    n_parallel: int = 1
    account_id: Any = None
    queued_ts: float = 0.0


def _try_slot(deployment_id: str, job_id: str, cap: int) -> bool:
    r = get_redis()
    return bool(r.eval(_SLOT_LUA, 2, f"racon:dep:{deployment_id}:inflight", f"racon:dep:{deployment_id}:waiting", cap, job_id))


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


def _admit(*, principal: KeyPrincipal, kind: str, v: dict[str, Any], request_id: str) -> Admission:
    """Find the model, reserve credits, create the job; dispatch when a slot is free."""
    model = Model.objects.filter(name=v["model"]).first()
    if model is None or not model.files.exists():
        raise ApiError(f"The model '{v['model']}' does not exist", status_code=404, param="model", code="model_not_found", type_="invalid_request_error")
    max_tokens = int(v.get("max_completion_tokens") or v.get("max_tokens") or settings.DEFAULT_MAX_TOKENS)
    params = _sampling(v)
    if kind == "chat":
        params["messages"] = v["messages"]
    else:
        params["prompt"] = v["prompt"]
    now = timezone.now()
    deployment = job_selectors.deployment_route(model_id=model.id)
    if deployment is not None and max_tokens > deployment.n_ctx:
        raise ApiError(
            f"max_tokens is too large: {max_tokens}. This model's context length is {deployment.n_ctx} tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    from apps.credits.services import InsufficientCredits  # noqa: PLC0415

    stream = bool(v.get("stream"))
    job_id = uuid.uuid4()
    fast = deployment if deployment is not None and deployment.state in (DeploymentState.READY, DeploymentState.DEGRADED) else None
    # Fast path: a free slot with nobody waiting. Push run_job first, then write the job row,
    # its credit hold and the dispatch in one transaction while the primary evaluates the prompt.
    # If the credits are short, the primary is told to cancel before any token reaches anyone.
    if fast is not None and _try_slot(str(fast.id), str(job_id), fast.n_parallel):
        job_services.command_send(
            node_id=fast.primary_id, kind="run_job",
            payload=job_services.job_run_payload(job_id=job_id, deployment_id=fast.id, kind=kind, max_tokens=max_tokens, params=params),
        )
        try:
            job_services.job_create(
                model=model, account_id=principal.account_id, api_key_id=principal.key_id, kind=kind, params=params,
                max_tokens=max_tokens, stream=stream, request_id=request_id, now=now, job_id=job_id, dispatched_to=fast,
            )
        except BaseException as exc:
            r = get_redis()
            r.set(job_cancel_key(str(job_id)), 1, ex=3600)
            r.decr(f"racon:dep:{fast.id}:inflight")
            if isinstance(exc, InsufficientCredits):
                raise ApiError(
                    f"You exceeded your current quota: {exc}", status_code=429, type_="insufficient_quota", code="insufficient_quota"
                ) from exc
            raise
        return Admission(
            job_id=str(job_id), model_name=model.name, deployment_id=str(fast.id), dispatched=True,
            nodes=[job_selectors.node_name(n) for n in job_services.dispatch_node_ids(fast)], n_parallel=fast.n_parallel,
            account_id=principal.account_id, queued_ts=now.timestamp(),
        )
    try:
        job = job_services.job_create(
            model=model, account_id=principal.account_id, api_key_id=principal.key_id, kind=kind, params=params,
            max_tokens=max_tokens, stream=stream, request_id=request_id, now=now, job_id=job_id,
        )
    except InsufficientCredits as exc:
        raise ApiError(
            f"You exceeded your current quota: {exc}", status_code=429, type_="insufficient_quota", code="insufficient_quota"
        ) from exc
    adm = Admission(job_id=str(job.id), model_name=model.name, account_id=principal.account_id, queued_ts=now.timestamp())
    if deployment is None:
        deployment = job_services.deployment_ensure(model=model, now=now)
    adm.deployment_id = str(deployment.id)
    adm.n_parallel = deployment.n_parallel
    if deployment.state in (DeploymentState.READY, DeploymentState.DEGRADED):
        _dispatch_if_free(adm, deployment)
    return adm


def _priority_score(account_id: Any, queued_ts: float) -> float:
    """Lower is served first: arrival time minus a standing bonus capped at the max wait (bounded starvation)."""
    bonus = 0.0
    try:
        from apps.credits.services import account_standing  # noqa: PLC0415

        standing = account_standing(account_ids=[account_id]).get(account_id, 0)
        bonus = min(float(settings.PRIORITY_MAX_WAIT_SECONDS), max(0.0, float(standing)) / 1_000_000.0)
    except ImportError:
        bonus = 0.0
    return queued_ts - bonus


def _dispatch_if_free(adm: Admission, deployment: Deployment) -> bool:
    """Take a slot and dispatch, or join the deployment's waiting queue (ordered by priority)."""
    r = get_redis()
    # Fast path: a free slot and nobody waiting ahead of us (the script checks both atomically).
    if not _try_slot(str(deployment.id), adm.job_id, deployment.n_parallel):
        waiting_key = f"racon:dep:{deployment.id}:waiting"
        if r.zscore(waiting_key, adm.job_id) is not None:
            return False
        if r.zcard(waiting_key) >= settings.JOB_QUEUE_MAX:
            job_services.job_fail(job_id=adm.job_id, now=timezone.now(), error="no capacity: queue full", during_execution=False)
            raise ApiError("The server is at capacity; retry shortly.", status_code=503, type_="server_error", code="no_capacity", headers={"Retry-After": "2"})
        # Standing is only worth computing when there is a queue to be ordered.
        r.zadd(waiting_key, {adm.job_id: _priority_score(adm.account_id, adm.queued_ts)})
        if not _try_slot(str(deployment.id), adm.job_id, deployment.n_parallel):
            return False
    try:
        out = job_services.job_dispatch(job_id=adm.job_id, deployment=deployment, now=timezone.now())
    except Exception:
        r.decr(f"racon:dep:{deployment.id}:inflight")
        raise
    adm.dispatched = True
    adm.nodes = [job_selectors.node_name(n) for n in out["nodes"]]
    return True


def _wait_step(adm: Admission) -> str:
    """One poll while waiting for a deployment or a slot: 'dispatched', 'wait' or 'failed:<reason>'."""
    dep = Deployment.objects.filter(pk=adm.deployment_id).first()
    if dep is None:
        return "failed:deployment vanished"
    if dep.state in (DeploymentState.FAILED, DeploymentState.STOPPED):
        return f"failed:{dep.error or 'deployment ' + dep.state.lower()}"
    if dep.state in (DeploymentState.READY, DeploymentState.DEGRADED):
        return "dispatched" if _dispatch_if_free(adm, dep) else "wait"
    return "wait"


def _give_up(adm: Admission, reason: str, *, status_code: int = 503) -> None:
    if adm.deployment_id:
        get_redis().zrem(f"racon:dep:{adm.deployment_id}:waiting", adm.job_id)
    job_services.job_fail(job_id=adm.job_id, now=timezone.now(), error=reason, during_execution=False)


# --- streaming --------------------------------------------------------------------------------


class StreamFailure(Exception):
    def __init__(self, message: str, *, code: str = "stream_error", during_execution: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.during_execution = during_execution


async def _entries(adm: Admission) -> AsyncIterator[dict[str, str]]:
    """Yield the job's stream entries in order; a gap, an idle stream or a dead primary raises."""
    r = get_async_redis()
    key = job_stream_key(adm.job_id)
    last_id = "0-0"
    expected = 0
    idle_limit = float(settings.STREAM_IDLE_TIMEOUT_SECONDS)
    idle_since = time.monotonic()
    while True:
        got = await r.xread({key: last_id}, block=1000, count=256)
        if not got:
            if time.monotonic() - idle_since > idle_limit:
                raise StreamFailure(f"no output from the primary for {idle_limit:.0f}s", code="primary_timeout")
            if await _primary_gone(adm):
                raise StreamFailure("the primary node of this deployment stopped responding", code="primary_lost")
            continue
        idle_since = time.monotonic()
        for entry_id, fields in got[0][1]:
            last_id = entry_id
            try:
                seq = int(fields.get("seq", -1))
            except ValueError:
                seq = -1
            if seq != expected:
                raise StreamFailure(f"token stream gap: expected chunk {expected}, got {seq}", code="stream_gap")
            expected += 1
            yield fields
            if fields.get("type") in ("done", "error"):
                return


async def _primary_gone(adm: Admission) -> bool:
    dep = await sync_to_async(lambda: Deployment.objects.filter(pk=adm.deployment_id).values("state", "primary_id").first())()
    if dep is None or dep["state"] in (DeploymentState.FAILED, DeploymentState.STOPPED):
        return True
    state = await get_async_redis().hget(f"racon:node:{dep['primary_id']}:meta", "state")
    return state in ("OFFLINE", "ERROR")


def _error_for_stream(fields: dict[str, str]) -> StreamFailure:
    text = fields.get("text") or "generation failed"
    low = text.lower()
    if "context" in low and ("exceed" in low or "too long" in low or "length" in low):
        return StreamFailure(text, code="context_length_exceeded", during_execution=False)
    return StreamFailure(text, code="runtime_error")


def _usage(fields: dict[str, str]) -> dict[str, Any]:
    try:
        return json.loads(fields.get("usage") or "{}") or {}
    except ValueError:
        return {}


def _finish_sync(adm: Admission, outcome: str, *, usage: dict[str, Any] | None = None, finish_reason: str = "stop", chunks: int = 0, error: str = "", during: bool | None = None) -> None:
    now = timezone.now()
    if outcome == "completed":
        job_services.job_complete(job_id=adm.job_id, usage=usage or {}, finish_reason=finish_reason, chunks=chunks, now=now)
    elif outcome == "cancelled":
        job_services.job_cancel(job_id=adm.job_id, now=now, reason=error or "client disconnected", usage=usage, chunks=chunks)
    else:
        job_services.job_fail(job_id=adm.job_id, now=now, error=error, during_execution=during, usage=usage, chunks=chunks)


def _cancel_in_background(adm: Admission, chunks: int) -> None:
    """Client gone: flag the primary at once (Redis), record CANCELLED off the cancelled task."""
    try:
        get_redis().set(job_cancel_key(adm.job_id), 1, ex=3600)
    except Exception:  # noqa: BLE001
        log.warning("could not set the cancel flag", exc_info=True)
    def run() -> None:
        try:
            _finish_sync(adm, "cancelled", chunks=chunks, error="client disconnected")
        finally:
            connections.close_all()  # this thread's own connection

    threading.Thread(target=run, daemon=True).start()


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
        v, adm = await sync_to_async(_authorize_and_admit)(header=header, kind=kind, body=body, request_id=request_id)
        with log_context(job_id=adm.job_id, deployment_id=adm.deployment_id):
            if not adm.dispatched:
                await _wait_for_dispatch(adm)
            log.info("job dispatched to %s", ",".join(adm.nodes))
            stream = bool(v.get("stream"))
            include_usage = bool((v.get("stream_options") or {}).get("include_usage"))
            entries = _entries(adm)
            # Read the first entry before answering: an early error (context too long) is a 400.
            try:
                first = await entries.__anext__()
            except StreamFailure as exc:
                await sync_to_async(_finish_sync)(adm, "failed", error=exc.message, during=True)
                raise ApiError(exc.message, status_code=502, type_="server_error", code=exc.code) from exc
            if first.get("type") == "error":
                failure = _error_for_stream(first)
                await sync_to_async(_finish_sync)(adm, "failed", error=failure.message, during=failure.during_execution, usage=_usage(first))
                if failure.code == "context_length_exceeded":
                    raise ApiError(failure.message, param="messages", code="context_length_exceeded")
                raise ApiError(failure.message, status_code=502, type_="server_error", code=failure.code)
            first_at = timezone.now()
            if stream:
                resp = StreamingHttpResponse(_sse_body(adm, kind, first, entries, include_usage, first_at), content_type="text/event-stream")
                resp["Cache-Control"] = "no-cache"
                resp["X-Accel-Buffering"] = "no"
                return _headers(resp, adm)
            await sync_to_async(job_services.job_mark_running)(job_id=adm.job_id, now=first_at)
            return _headers(await _collect(adm, kind, first, entries), adm)
    except ApiError as exc:
        if adm is not None and exc.status_code >= 500:
            await sync_to_async(_finish_sync)(adm, "failed", error=exc.message, during=False)
        resp = exc.response()
        if adm is not None:
            _headers(resp, adm)
        return resp
    except Exception:
        log.exception("internal error in %s completion", kind)
        if adm is not None:
            await sync_to_async(_finish_sync)(adm, "failed", error="internal error", during=None)
        return ApiError("The server had an error while processing your request.", status_code=500, type_="server_error", code="internal_error").response()


async def _wait_for_dispatch(adm: Admission) -> None:
    """Wait (bounded) for the deployment to become READY and for a slot; else 503 with Retry-After."""
    deadline = time.monotonic() + max(settings.DEPLOYMENT_WAIT_SECONDS, settings.JOB_QUEUE_WAIT_SECONDS)
    slot_deadline: float | None = None
    delay = 0.02
    while True:
        status = await sync_to_async(_wait_step)(adm)
        if status == "dispatched":
            return
        if status.startswith("failed:"):
            reason = status.split(":", 1)[1]
            await sync_to_async(_give_up)(adm, f"no deployment could serve the request: {reason}")
            raise ApiError(f"No deployment of this model is available: {reason}", status_code=503, type_="server_error", code="no_capacity", headers={"Retry-After": "30"})
        now = time.monotonic()
        dep_ready = await sync_to_async(lambda: Deployment.objects.filter(pk=adm.deployment_id, state__in=[DeploymentState.READY, DeploymentState.DEGRADED]).exists())()
        if dep_ready and slot_deadline is None:
            slot_deadline = now + settings.JOB_QUEUE_WAIT_SECONDS
        if now > deadline or (slot_deadline is not None and now > slot_deadline):
            await sync_to_async(_give_up)(adm, "timed out waiting for capacity")
            raise ApiError("The model is busy or still loading; retry shortly.", status_code=503, type_="server_error", code="no_capacity", headers={"Retry-After": "5"})
        await asyncio.sleep(delay)
        delay = min(0.25, delay * 1.5)


async def _sse_body(
    adm: Admission, kind: str, first: dict[str, str], entries: AsyncIterator[dict[str, str]], include_usage: bool, first_at: Any
) -> AsyncIterator[bytes]:
    created = int(time.time())
    chunks = 0
    finished = False
    marked_running = False
    try:
        if kind == "chat":
            yield _sse(_chat_chunk(adm, created, {"role": "assistant", "content": ""}, None, None, include_usage))
        entry: dict[str, str] | None = first
        while entry is not None:
            etype = entry.get("type")
            if etype == "chunk":
                chunks += 1
                text = entry.get("text", "")
                if kind == "chat":
                    yield _sse(_chat_chunk(adm, created, {"content": text}, None, None, include_usage))
                else:
                    yield _sse(_text_chunk(adm, created, text, None, None, include_usage))
                if not marked_running:
                    # Recorded after the first token is on the wire, not in front of it.
                    marked_running = True
                    await sync_to_async(job_services.job_mark_running)(job_id=adm.job_id, now=first_at)
            elif etype == "done":
                usage = _usage(entry)
                fr = entry.get("finish_reason") or "stop"
                if fr == "cancelled":
                    finished = True
                    await sync_to_async(_finish_sync)(adm, "cancelled", usage=usage, chunks=chunks, error="cancelled")
                    yield _sse({"error": {"message": "The request was cancelled.", "type": "server_error", "param": None, "code": "cancelled"}})
                    yield b"data: [DONE]\n\n"
                    return
                if kind == "chat":
                    yield _sse(_chat_chunk(adm, created, {}, fr, None, include_usage))
                else:
                    yield _sse(_text_chunk(adm, created, "", fr, None, include_usage))
                if include_usage:
                    final = (_chat_chunk if kind == "chat" else _text_chunk)(adm, created, {} if kind == "chat" else "", None, _openai_usage(usage), True)  # type: ignore[operator]
                    final["choices"] = []
                    yield _sse(final)
                finished = True
                # The client has everything: send [DONE] first, then record the job (settlement
                # and metrics) before the response closes, so a client that reads to the end
                # still finds the job COMPLETED.
                yield b"data: [DONE]\n\n"
                await sync_to_async(_finish_sync)(adm, "completed", usage=usage, finish_reason=fr, chunks=chunks)
                return
            elif etype == "error":
                failure = _error_for_stream(entry)
                finished = True
                await sync_to_async(_finish_sync)(adm, "failed", error=failure.message, during=True, usage=_usage(entry), chunks=chunks)
                yield _sse({"error": {"message": failure.message, "type": "server_error", "param": None, "code": failure.code}})
                yield b"data: [DONE]\n\n"
                return
            try:
                entry = await entries.__anext__()
            except StopAsyncIteration:
                entry = None
    except StreamFailure as exc:
        finished = True
        await sync_to_async(_finish_sync)(adm, "failed", error=exc.message, during=True, chunks=chunks)
        yield _sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            _cancel_in_background(adm, chunks)


async def _collect(adm: Admission, kind: str, first: dict[str, str], entries: AsyncIterator[dict[str, str]]) -> HttpResponse:
    parts: list[str] = []
    chunks = 0
    entry: dict[str, str] | None = first
    try:
        while entry is not None:
            etype = entry.get("type")
            if etype == "chunk":
                chunks += 1
                parts.append(entry.get("text", ""))
            elif etype == "done":
                usage = _usage(entry)
                fr = entry.get("finish_reason") or "stop"
                if fr == "cancelled":
                    await sync_to_async(_finish_sync)(adm, "cancelled", usage=usage, chunks=chunks, error="cancelled")
                    raise ApiError("The request was cancelled.", status_code=499, type_="server_error", code="cancelled")
                await sync_to_async(_finish_sync)(adm, "completed", usage=usage, finish_reason=fr, chunks=chunks)
                text = "".join(parts)
                created = int(time.time())
                if kind == "chat":
                    body = {
                        "id": f"chatcmpl-{adm.job_id}", "object": "chat.completion", "created": created, "model": adm.model_name,
                        "system_fingerprint": None,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None, "finish_reason": fr}],
                        "usage": _openai_usage(usage),
                    }
                else:
                    body = {
                        "id": f"cmpl-{adm.job_id}", "object": "text_completion", "created": created, "model": adm.model_name,
                        "system_fingerprint": None,
                        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": fr}],
                        "usage": _openai_usage(usage),
                    }
                return JsonResponse(body)
            elif etype == "error":
                failure = _error_for_stream(entry)
                await sync_to_async(_finish_sync)(adm, "failed", error=failure.message, during=True, usage=_usage(entry), chunks=chunks)
                raise ApiError(failure.message, status_code=502, type_="server_error", code=failure.code)
            entry = await entries.__anext__()
    except StreamFailure as exc:
        await sync_to_async(_finish_sync)(adm, "failed", error=exc.message, during=True, chunks=chunks)
        raise ApiError(exc.message, status_code=502, type_="server_error", code=exc.code) from exc
    except (asyncio.CancelledError, GeneratorExit):
        _cancel_in_background(adm, chunks)
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
