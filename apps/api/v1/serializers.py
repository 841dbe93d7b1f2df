"""The /v1 request bodies: OpenAI's fields, validated, and their errors in OpenAI's terms."""

from __future__ import annotations

import functools
import re
from collections.abc import Set as AbstractSet
from typing import Any

from rest_framework import serializers

from agent.protocol import SAMPLING_DEFAULTS

from ..errors import ApiError
from . import agentic as agentic_tools


class _ContentPart(serializers.Serializer):
    type = serializers.ChoiceField(choices=["text"])
    text = serializers.CharField(allow_blank=True, trim_whitespace=False)


def _text(content: Any, *, allow_none: bool) -> str | None:
    """A message's text: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, list):
        parts = _ContentPart(data=content, many=True)
        if not parts.is_valid():
            raise serializers.ValidationError("content parts must be {'type': 'text', 'text': ...}")
        return "".join(p["text"] for p in parts.validated_data)
    if content is None and allow_none:
        return None
    if not isinstance(content, str):
        raise serializers.ValidationError("content must be a string or a list of text parts")
    return content


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, in OpenAI's shape (arguments a JSON string)."""
    if not isinstance(calls, list):
        raise serializers.ValidationError("tool_calls must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(c.get("id"), str)
            or c.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise serializers.ValidationError(
                "each tool call must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}"
            )
        out.append(
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


class MessageField(serializers.Field):
    """One chat message: a role and its text (a string, or OpenAI's list of text parts); an
    assistant's ``tool_calls``, a tool result's ``tool_call_id``."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("each message must be an object")
        role = data.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise serializers.ValidationError(
                f"role must be one of system, developer, user, assistant, tool; got {role!r}"
            )
        if role == "assistant":
            calls = _tool_calls(data["tool_calls"]) if data.get("tool_calls") else []
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": _text(data.get("content"), allow_none=True) or "",
            }
            if calls:
                msg["tool_calls"] = calls
            return msg
        content = _text(data.get("content"), allow_none=False)
        if role == "tool":
            call_id = data.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise serializers.ValidationError("a tool message needs its 'tool_call_id'")
            return {"role": "tool", "content": content, "tool_call_id": call_id}
        return {"role": "system" if role == "developer" else role, "content": content}

    def to_representation(self, value: Any) -> Any:
        return value


class ToolField(serializers.Field):
    """One entry of ``tools``: ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}``."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        fn = data.get("function") if isinstance(data, dict) else None
        if not isinstance(fn, dict) or data.get("type") != "function":
            raise serializers.ValidationError(
                "each tool must be {'type': 'function', 'function': {...}}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise serializers.ValidationError(
                "function.name must be 1-64 letters, digits, underscores or dashes"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise serializers.ValidationError("function.parameters must be a JSON schema object")
        out: dict[str, Any] = {"name": name}
        if isinstance(fn.get("description"), str):
            out["description"] = fn["description"]
        out["parameters"] = params or {"type": "object", "properties": {}}
        return {"type": "function", "function": out}

    def to_representation(self, value: Any) -> Any:
        return value


class ToolChoiceField(serializers.Field):
    """``tool_choice``: "none", "auto", "required", or ``{"type": "function", "function": {"name"}}``."""

    def to_internal_value(self, data: Any) -> Any:
        if data in ("none", "auto", "required"):
            return data
        fn = data.get("function") if isinstance(data, dict) else None
        if (
            isinstance(fn, dict)
            and data.get("type") == "function"
            and isinstance(fn.get("name"), str)
        ):
            return {"type": "function", "function": {"name": fn["name"]}}
        raise serializers.ValidationError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )

    def to_representation(self, value: Any) -> Any:
        return value


class ResponseFormatField(serializers.Field):
    """``response_format``: the JSON schema the output must match ({} for text)."""

    def to_internal_value(self, data: Any) -> dict[str, Any] | None:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = data.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise serializers.ValidationError(
                    "json_schema must be {'name': ..., 'schema': {...}, 'strict'?: bool}"
                )
            schema = spec.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise serializers.ValidationError("json_schema.schema must be an object")
            return schema or {"type": "object"}
        raise serializers.ValidationError(
            "response_format.type must be 'text', 'json_object' or 'json_schema'"
        )

    def to_representation(self, value: Any) -> Any:
        return value


class StopField(serializers.Field):
    """``stop``: a string or up to four strings, always a list once validated."""

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
    max_tokens = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=1_000_000
    )
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=2)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    stop = StopField(required=False, allow_null=True)
    seed = serializers.IntegerField(required=False, allow_null=True)
    presence_penalty = serializers.FloatField(
        required=False, allow_null=True, min_value=-2, max_value=2
    )
    frequency_penalty = serializers.FloatField(
        required=False, allow_null=True, min_value=-2, max_value=2
    )
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)

    def validate_n(self, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise serializers.ValidationError(
                "n > 1 is not supported: RACoN returns one choice per request"
            )
        return value


class ChatCompletionIn(_CommonParams):
    messages = serializers.ListField(child=MessageField(), allow_empty=False, max_length=2048)
    max_completion_tokens = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=1_000_000
    )
    tools = serializers.ListField(
        child=ToolField(), required=False, allow_null=True, allow_empty=True, max_length=128
    )
    tool_choice = ToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)
    response_format = ResponseFormatField(required=False, allow_null=True)
    logprobs = serializers.BooleanField(required=False, allow_null=True)
    top_logprobs = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=20
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        tools = attrs.get("tools") or []
        choice = attrs.get("tool_choice")
        if choice not in (None, "none", "auto") and not tools:
            raise serializers.ValidationError({"tool_choice": "tool_choice needs 'tools'"})
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in {t["function"]["name"] for t in tools}:
                raise serializers.ValidationError(
                    {"tool_choice": f"no tool named {name!r} is in 'tools'"}
                )
        if attrs.get("top_logprobs") is not None and not attrs.get("logprobs"):
            raise serializers.ValidationError(
                {"top_logprobs": "logprobs must be true when top_logprobs is set"}
            )
        return attrs


class CompletionIn(_CommonParams):
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)
    # The legacy API's logprobs: how many of the likeliest tokens to list at each position.
    logprobs = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=5)


# Parameters RACoN accepts and ignores: they never change the output (docs/api, "Parameters").
HARMLESS = frozenset(
    {"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "user"}
)
# Parameters that would change the output and that RACoN does not honour: a 400 naming them,
# unless the value is the neutral one (null, false, empty, n=1, text-only modalities).
REFUSED = {
    "chat": {
        "logit_bias": "logit_bias is not supported",
        "audio": "audio output is not supported: RACoN serves text models",
        "modalities": "only the 'text' modality is supported",
        "prediction": "predicted outputs are not supported",
        "functions": "the legacy 'functions' parameter is not supported; use 'tools'",
        "function_call": "the legacy 'function_call' parameter is not supported; use 'tool_choice'",
        "web_search_options": "web search is not supported",
        "reasoning_effort": "reasoning_effort is not supported: RACoN's models do not reason",
        "verbosity": "verbosity is not supported",
    },
    "completion": {
        "logit_bias": "logit_bias is not supported",
        "echo": "echo is not supported",
        "best_of": "best_of > 1 is not supported: RACoN returns one choice per request",
        "suffix": "suffix (insertion) is not supported",
    },
}


def _neutral(name: str, value: Any) -> bool:
    if value is None or value is False or value == [] or value == {} or value == "":
        return True
    if name == "modalities":
        return value == ["text"]
    return name == "best_of" and value == 1


def refuse_unsupported(*, kind: str, body: dict[str, Any], fields: AbstractSet[str]) -> None:
    """ApiError 400 naming the first parameter RACoN would otherwise silently ignore."""
    for name, value in body.items():
        reason = REFUSED[kind].get(name)
        if reason is not None:
            if _neutral(name, value):
                continue
            raise ApiError(
                f"Unsupported parameter: '{name}': {reason}.",
                param=name,
                code="unsupported_parameter",
            )
        if name not in fields and name not in HARMLESS:
            raise ApiError(
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )


def first_error(errors: Any, prefix: str = "") -> tuple[str, str]:
    """(param, message) of the first validation error, param in OpenAI's dotted form."""
    if isinstance(errors, dict):
        for key, value in errors.items():
            if prefix and not str(key).isdigit():
                name = f"{prefix}.{key}"
            else:
                name = f"{prefix}[{key}]" if prefix else str(key)
            return first_error(value, name)
    if isinstance(errors, list) and errors:
        for i, value in enumerate(errors):
            if value:
                if isinstance(value, dict | list) and not isinstance(value, str):
                    return first_error(
                        value, f"{prefix}[{i}]" if isinstance(value, dict) else prefix
                    )
                return prefix, str(value)
    return prefix, str(errors)


@functools.cache
def _field_names(serializer_cls: type[serializers.Serializer]) -> frozenset[str]:
    """A request serializer's parameter names, built once: a serializer's fields are deep copies
    made per instance, one more per request only to read their names."""
    return frozenset(serializer_cls().fields)


def validate(serializer_cls: type[serializers.Serializer], body: Any) -> dict[str, Any]:
    """The validated body, or ApiError 400 naming the first bad parameter as OpenAI does."""
    if not isinstance(body, dict):
        raise ApiError(
            "the request body must be a JSON object", param=None, code="invalid_request_body"
        )
    refuse_unsupported(
        kind="chat" if serializer_cls is ChatCompletionIn else "completion",
        body=body,
        fields=_field_names(serializer_cls),
    )
    s = serializer_cls(data=body)
    if not s.is_valid():
        param, message = first_error(s.errors)
        top = param.split(".")[0].split("[")[0]
        if top == "messages" and "empty" in message.lower():
            message = "messages must contain at least one message"
        raise ApiError(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")
    return dict(s.validated_data)


def sampling(v: dict[str, Any]) -> dict[str, Any]:
    """The run's sampling parameters: the request's, else OpenAI's defaults (agent.protocol)."""
    d = SAMPLING_DEFAULTS
    return {
        "temperature": d["temperature"]
        if v.get("temperature") is None
        else float(v["temperature"]),
        "top_p": d["top_p"] if v.get("top_p") is None else float(v["top_p"]),
        "stop": v.get("stop") or [],
        "seed": v.get("seed"),
        "presence_penalty": (
            d["presence_penalty"]
            if v.get("presence_penalty") is None
            else float(v["presence_penalty"])
        ),
        "frequency_penalty": (
            d["frequency_penalty"]
            if v.get("frequency_penalty") is None
            else float(v["frequency_penalty"])
        ),
    }


def max_tokens_asked(v: dict[str, Any]) -> int | None:
    """The completion-token limit the request sets (``max_completion_tokens`` first), if any."""
    got = v.get("max_completion_tokens") or v.get("max_tokens")
    return int(got) if got else None


def agentic(v: dict[str, Any], *, kind: str) -> dict[str, Any]:
    """The run's tool, structured-output and logprob parameters (protocol.RunJobPayload).

    ``tool_mode``: "none", "auto" or "forced"; a forced call is constrained by its JSON schema
    (apps/api/v1/agentic.py), else ``response_format``'s schema constrains the text.
    """
    out: dict[str, Any] = {}
    if kind == "chat":
        tools = v.get("tools") or []
        mode = agentic_tools.tool_mode(tools=tools, tool_choice=v.get("tool_choice"))
        parallel = v.get("parallel_tool_calls")
        if tools:
            out["tools"] = tools
            out["tool_choice"] = v.get("tool_choice") or "auto"
            out["parallel_tool_calls"] = True if parallel is None else bool(parallel)
            out["tool_mode"] = mode
        schema = v.get("response_format")
        if mode == "forced":
            schema = agentic_tools.forced_call_schema(tools=tools, tool_choice=v["tool_choice"])
        if schema is not None:
            out["json_schema"] = schema
        if v.get("logprobs"):
            out["logprobs"] = True
            out["top_logprobs"] = int(v.get("top_logprobs") or 0)
    elif v.get("logprobs") is not None:
        out["logprobs"] = True
        out["top_logprobs"] = int(v["logprobs"])
    return out
