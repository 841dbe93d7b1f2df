"""Tool calls and logprobs for /v1: pure functions, no Django, no I/O (docs/design/serving.md,
"Tool calls, structured output and logprobs").

- A forced call (``tool_choice`` "required" or a named function) is constrained by a JSON schema
  (``forced_call_schema``): llama-server turns it into a grammar, so the output IS one call,
  ``{"name": ..., "arguments": {...}}``, valid against the function's parameters, whatever the
  model or its chat template.
- With ``tool_choice`` "auto" the model decides; its output is split into text and calls by
  ``ToolCallSplitter``: ``<tool_call>{json}</tool_call>`` blocks (the format the agent asks for
  when the template knows no tools, and Hermes/Qwen templates' own), or a bare JSON call.
- Every call gets OpenAI's shape: ``{"id": "call_…", "type": "function", "function": {"name",
  "arguments"}}`` with ``arguments`` a JSON string.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

ToolMode = str  # "none" (no tools in play), "auto" (the model may call), "forced" (it must)


@dataclass(frozen=True)
class Shaping:
    """How one request's output becomes OpenAI's answer: its tool mode, the functions it may
    call, whether several calls may come back, and whether logprobs were asked for."""

    mode: ToolMode = "none"
    names: frozenset[str] = field(default_factory=frozenset)
    parallel: bool = True
    logprobs: bool = False

    @classmethod
    def of(cls, params: dict[str, Any]) -> Shaping:
        """From the job's params (serializers.agentic)."""
        return cls(
            mode=str(params.get("tool_mode") or "none"),
            names=frozenset(t["function"]["name"] for t in params.get("tools") or []),
            parallel=bool(params.get("parallel_tool_calls", True)),
            logprobs=bool(params.get("logprobs")),
        )


def tool_mode(*, tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolMode:
    """How the job treats tools: "none", "auto" or "forced" (OpenAI's default is auto with tools)."""
    if not tools or tool_choice == "none":
        return "none"
    if tool_choice in (None, "auto"):
        return "auto"
    return "forced"


def forced_call_schema(*, tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
    """The JSON schema of exactly one call: to the named function, or (required) any of them.

    One call, even with parallel_tool_calls: a grammar that allows several lets a small model
    repeat the same call until max_tokens (seen with SmolLM2), and one call satisfies both.
    """
    chosen = [
        t
        for t in tools
        if not isinstance(tool_choice, dict)
        or t["function"]["name"] == tool_choice["function"]["name"]
    ]
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in chosen
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def new_call_id() -> str:
    """An id in OpenAI's form: ``call_`` and 24 characters."""
    return "call_" + secrets.token_hex(12)


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape; ``arguments`` becomes a JSON string (kept when it is one)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_from(obj: Any, names: frozenset[str] | set[str]) -> dict[str, Any] | None:
    """A call from one parsed JSON object, or None when it is not a call to a known function."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return tool_call(name, args)


def parse_forced_call(text: str, names: frozenset[str] | set[str]) -> dict[str, Any] | None:
    """The call a grammar-constrained output holds, or None (it was cut short by max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call_from(obj, names)


def parse_tool_calls(text: str, names: frozenset[str] | set[str]) -> list[dict[str, Any]]:
    """The calls in a model's free output from a tool-call marker on ([] when it holds none, or
    any of them is malformed: then the whole output stays text)."""
    stripped = text.strip()
    if not stripped:
        return []
    if stripped.startswith(TOOL_CALL_OPEN):
        calls = []
        for block in _BLOCK_RE.findall(stripped):
            try:
                call = _call_from(json.loads(block), names)
            except ValueError:
                return []
            if call is None:
                return []
            calls.append(call)
        return calls
    try:
        obj = json.loads(stripped)
    except ValueError:
        return []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [c for c in (_call_from(o, names) for o in objs) if c is not None]
    return calls if calls and len(calls) == len(objs) else []


class ToolCallSplitter:
    """Splits a streamed auto-mode output into text to send now and a held tool-call part.

    Text is released as it comes, except what could begin a call: from a ``<tool_call>`` marker
    on (and the tail that may be the start of one), or the whole output when it starts with a
    JSON object or array (a template's bare-JSON calls). ``finish`` parses what was held: calls,
    or (when it holds none) text after all.
    """

    def __init__(self, names: frozenset[str] | set[str]) -> None:
        self.names = names
        self._pending = ""  # not yet released: a possible marker prefix, or the held call
        self._holding = False
        self._started = False  # something other than whitespace was released or held

    def feed(self, text: str) -> str:
        """Text that can be sent now."""
        if self._holding:
            self._pending += text
            return ""
        buf = self._pending + text
        if not self._started:
            lead = buf.lstrip()
            if not lead:
                self._pending = buf
                return ""
            self._started = True
            if lead[0] in "{[":
                self._holding, self._pending = True, buf
                return ""
        at = buf.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._holding, self._pending = True, buf[at:]
            return buf[:at]
        keep = _marker_prefix_len(buf)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(text still to send, calls) at the end of the output."""
        held, self._pending = self._pending, ""
        if not self._holding:
            return held, []
        calls = parse_tool_calls(held, self.names)
        return ("", calls) if calls else (held, [])


def _marker_prefix_len(buf: str) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of the marker."""
    for n in range(min(len(buf), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(buf[-n:]):
            return n
    return 0


def split_content(
    text: str, *, mode: ToolMode, names: frozenset[str] | set[str], parallel: bool
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as OpenAI's (content, tool_calls) for the job's tool mode."""
    if mode == "forced":
        call = parse_forced_call(text, names)
        return (None, [call]) if call is not None else (text, [])
    if mode == "auto":
        splitter = ToolCallSplitter(names)
        before = splitter.feed(text)
        rest, calls = splitter.finish()
        if calls:
            return (before.strip() or None), calls[: None if parallel else 1]
        return before + rest, []
    return text, []


def stream_tool_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``delta.tool_calls`` entries of calls streamed whole: index, id, type, function."""
    return [{"index": i, **c} for i, c in enumerate(calls)]


def chat_logprobs(probs: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a chat answer or chunk: OpenAI's ``{"content", "refusal"}``."""
    if probs is None:
        return None
    return {"content": probs, "refusal": None}


def completion_logprobs(
    probs: list[dict[str, Any]] | None, offset: int = 0
) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a legacy completion: tokens, token_logprobs, top_logprobs
    (a dict per token) and text_offset (``offset``: characters sent before these tokens)."""
    if probs is None:
        return None
    offsets = []
    for p in probs:
        offsets.append(offset)
        offset += len(p["token"])
    return {
        "tokens": [p["token"] for p in probs],
        "token_logprobs": [p["logprob"] for p in probs],
        "top_logprobs": [{t["token"]: t["logprob"] for t in p["top_logprobs"]} for p in probs],
        "text_offset": offsets,
    }
