"""A job's request to llama-server, shaped for tools, structured output and logprobs (pure, no I/O).

docs/design/serving.md, "Tool calls, structured output and logprobs":
- A template that knows tools (llama-server's ``/props`` caps ``supports_tools``) gets them through
  ``/apply-template`` (``tools``, ``tool_choice``, ``parallel_tool_calls``) and renders the history
  its own way.
- A template that does not (SmolLM2's) would drop them silently: the agent writes them into the
  system message itself, asks for ``<tool_call>{"name", "arguments"}</tool_call>`` (the controller
  parses that), and rewrites the history in the same words: an assistant's calls as those blocks,
  a tool result as a user message in ``<tool_response>`` tags.
- The output's constraint (``json_schema``) is the controller's: a forced call's schema, or
  ``response_format``'s.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the "
    "user query. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
ONE_CALL = "Call at most one function at a time."
MUST_CALL = "You must call a function now."
MUST_CALL_NAMED = "You must call the function {name} now."


def tools_system_text(
    tools: list[dict[str, Any]], *, tool_choice: Any = "auto", parallel: bool = True
) -> str:
    """The system text that describes the tools to a model whose template knows none."""
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    text = TOOLS_SYSTEM.format(tools=listed)
    if not parallel:
        text += "\n" + ONE_CALL
    if tool_choice == "required":
        text += "\n" + MUST_CALL
    elif isinstance(tool_choice, dict):
        text += "\n" + MUST_CALL_NAMED.format(name=tool_choice["function"]["name"])
    return text


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    try:
        args: Any = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = fn.get("arguments")
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def plain_history(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages any template renders: {role, content} only, tool calls and results in words.

    Tool results next to each other (parallel calls) become one user message.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{blocks}".strip()})
        elif role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if (
                out
                and out[-1]["role"] == "user"
                and out[-1]["content"].endswith("</tool_response>")
            ):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
        else:
            out.append({"role": str(role), "content": str(content)})
    return out


def template_request(job: dict[str, Any], *, template_has_tools: bool) -> dict[str, Any]:
    """The body of ``/apply-template`` for a chat job."""
    messages: list[dict[str, Any]] = list(job.get("messages") or [])
    tools = list(job.get("tools") or [])
    choice = job.get("tool_choice") or "auto"
    parallel = bool(job.get("parallel_tool_calls", True))
    if template_has_tools:
        body: dict[str, Any] = {"messages": messages}
        if tools:
            # A named choice is the controller's to enforce (its schema); the template is told
            # a call is required.
            body["tools"] = tools
            body["tool_choice"] = "required" if isinstance(choice, dict) else choice
            body["parallel_tool_calls"] = parallel
        return body
    plain = plain_history(messages)
    if tools and choice != "none":
        text = tools_system_text(tools, tool_choice=choice, parallel=parallel)
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": plain[0]["content"] + "\n\n" + text}
        else:
            plain.insert(0, {"role": "system", "content": text})
    return {"messages": plain}


def token_probs(event_probs: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities`` as OpenAI's logprobs content entries, with at
    most ``top`` alternatives each."""
    out = []
    for p in event_probs:
        out.append(
            {
                "token": p.get("token", ""),
                "logprob": float(p.get("logprob", 0.0)),
                "bytes": list(p.get("bytes") or []),
                "top_logprobs": [
                    {
                        "token": t.get("token", ""),
                        "logprob": float(t.get("logprob", 0.0)),
                        "bytes": list(t.get("bytes") or []),
                    }
                    for t in (p.get("top_logprobs") or [])[:top]
                ],
            }
        )
    return out
