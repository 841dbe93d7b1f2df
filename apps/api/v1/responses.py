"""OpenAI's response shapes for /v1: completion bodies, stream chunks, usage, SSE framing, headers.

Every dict here keeps OpenAI's key order: clients and tests compare the bytes.
"""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpResponseBase

from apps.jobs.serving import Admission

from . import agentic

DONE = b"data: [DONE]\n\n"


def chat_chunk(
    adm: Admission,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    usage: Any = None,
    with_usage_field: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``usage`` is present (null until the last) with include_usage."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{adm.job_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": adm.model_name,
        "system_fingerprint": None,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if with_usage_field:
        body["usage"] = usage
    return body


def text_chunk(
    adm: Admission,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: Any = None,
    with_usage_field: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    body: dict[str, Any] = {
        "id": f"cmpl-{adm.job_id}",
        "object": "text_completion",
        "created": created,
        "model": adm.model_name,
        "system_fingerprint": None,
        "choices": [
            {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if with_usage_field:
        body["usage"] = usage
    return body


def content_chunk(
    adm: Admission,
    kind: str,
    created: int,
    text: str,
    include_usage: bool,
    probs: list[dict[str, Any]] | None = None,
    offset: int = 0,
) -> dict[str, Any]:
    """The chunk carrying one piece of generated text (and its tokens' logprobs, when asked;
    ``offset``: characters sent before it, the legacy logprobs' text_offset)."""
    if kind == "chat":
        return chat_chunk(
            adm, created, {"content": text}, None, None, include_usage, agentic.chat_logprobs(probs)
        )
    lp = agentic.completion_logprobs(probs, offset)
    return text_chunk(adm, created, text, None, None, include_usage, lp)


def tool_calls_chunk(
    adm: Admission,
    created: int,
    calls: list[dict[str, Any]],
    include_usage: bool,
    probs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The chunk carrying whole tool calls: ``delta.tool_calls`` with index, id, type, function."""
    delta = {"tool_calls": agentic.stream_tool_call_deltas(calls)}
    return chat_chunk(adm, created, delta, None, None, include_usage, agentic.chat_logprobs(probs))


def finish_chunk(
    adm: Admission, kind: str, created: int, finish_reason: str, include_usage: bool
) -> dict[str, Any]:
    """The chunk with the finish reason and no text."""
    if kind == "chat":
        return chat_chunk(adm, created, {}, finish_reason, None, include_usage)
    return text_chunk(adm, created, "", finish_reason, None, include_usage)


def usage_chunk(adm: Admission, kind: str, created: int, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    if kind == "chat":
        final = chat_chunk(adm, created, {}, None, usage, True)
    else:
        final = text_chunk(adm, created, "", None, usage, True)
    final["choices"] = []
    return final


def usage_body(u: dict[str, Any]) -> dict[str, int]:
    """OpenAI's usage object from the recorded usage."""
    p = int(u.get("prompt_tokens") or 0)
    c = int(u.get("completion_tokens") or 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_body(
    adm: Admission,
    kind: str,
    created: int,
    text: str | None,
    finish_reason: str,
    usage: dict[str, int],
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    probs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole answer of a non-streamed request (``text`` None: only tool calls)."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "id": f"chatcmpl-{adm.job_id}",
            "object": "chat.completion",
            "created": created,
            "model": adm.model_name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": agentic.chat_logprobs(probs),
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage,
        }
    return {
        "id": f"cmpl-{adm.job_id}",
        "object": "text_completion",
        "created": created,
        "model": adm.model_name,
        "system_fingerprint": None,
        "choices": [
            {
                "text": text,
                "index": 0,
                "logprobs": agentic.completion_logprobs(probs),
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
    }


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_error(message: str, code: str | None) -> bytes:
    """An error inside a stream that already began (the status was sent): OpenAI's error body."""
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def with_job_headers[R: HttpResponseBase](resp: R, adm: Admission) -> R:
    """RACoN's headers naming the job, its nodes and its deployment."""
    resp["X-Racon-Job-Id"] = adm.job_id
    resp["X-Racon-Nodes"] = ",".join(adm.nodes)
    if adm.deployment_id:
        resp["X-Racon-Deployment-Id"] = adm.deployment_id
    return resp


def models_body(models: list[Any]) -> dict[str, Any]:
    """``/v1/models``: OpenAI's list of model objects."""
    return {"object": "list", "data": [model_body(m) for m in models]}


def model_body(m: Any) -> dict[str, Any]:
    """One model object."""
    return {
        "id": m.name,
        "object": "model",
        "created": int(m.created_at.timestamp()),
        "owned_by": "racon",
    }
