"""The /v1 request bodies: OpenAI's fields, validated, and their errors in OpenAI's terms."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from agent.protocol import SAMPLING_DEFAULTS

from ..errors import ApiError


class _ContentPart(serializers.Serializer):
    type = serializers.ChoiceField(choices=["text"])
    text = serializers.CharField(allow_blank=True, trim_whitespace=False)


class MessageField(serializers.Field):
    """One chat message: a role and its text (a string, or OpenAI's list of text parts)."""

    def to_internal_value(self, data: Any) -> dict[str, str]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("each message must be an object")
        role = data.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise serializers.ValidationError(
                f"role must be one of system, user, assistant; got {role!r}"
            )
        content = data.get("content")
        if isinstance(content, list):
            parts = _ContentPart(data=content, many=True)
            if not parts.is_valid():
                raise serializers.ValidationError(
                    "content parts must be {'type': 'text', 'text': ...}"
                )
            content = "".join(p["text"] for p in parts.validated_data)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise serializers.ValidationError("content must be a string or a list of text parts")
        return {"role": "system" if role == "developer" else role, "content": content}

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


class CompletionIn(_CommonParams):
    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)


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


def validate(serializer_cls: type[serializers.Serializer], body: Any) -> dict[str, Any]:
    """The validated body, or ApiError 400 naming the first bad parameter as OpenAI does."""
    if not isinstance(body, dict):
        raise ApiError(
            "the request body must be a JSON object", param=None, code="invalid_request_body"
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
