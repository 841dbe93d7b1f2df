"""The model's chat template rendered in the agent, so a plain chat turn costs llama-server one
request (/completion) instead of two.

``/apply-template`` is answered by the server that is busy generating: under load it added about
160 ms to the median time to first token at 8 streams (a side-by-side probe on one llama-server:
393-413 ms with the round trip, 232-236 ms with the prompt rendered beforehand). The template comes
from the server's own ``/props`` and renders in a jinja2 sandbox, as Hugging Face's tokenizers do.
It is used only when it renders probe conversations exactly as ``/apply-template`` does: a
template that llama.cpp's own engine renders otherwise keeps the round trip. Jobs with tools, or
with content that is not a string, always take the round trip (agent/runtime/prompting.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("agent.runtime.template")

# What a template may raise while rendering: its own errors (raise_exception, undefined names,
# the sandbox) and Python's from expressions on the wrong types.
RENDER_ERRORS = (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError)

# Conversations the local rendering must reproduce byte for byte before it is trusted: the shapes
# plain chat jobs have (a first user turn; a system prompt and a multi-turn history; text with
# newlines, markup and non-ASCII characters).
PROBES: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    [{"role": "user", "content": "Line one\nline two: <b>«ünïcode»</b> {{ not a tag }} 🚀"}],
)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class LocalTemplate:
    """A chat template compiled once; ``render`` gives the prompt for a list of messages."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt; raises one of RENDER_ERRORS when the template refuses the messages."""
        return self._template.render(
            messages=list(messages), add_generation_prompt=True, **self._tokens
        )

    @classmethod
    def verified(
        cls,
        props: dict[str, Any],
        reference: Callable[[list[dict[str, str]]], str | None],
        *,
        name: str = "",
    ) -> LocalTemplate | None:
        """The template of llama-server's ``/props`` when it renders every probe as ``reference``
        (the server's /apply-template; None when it cannot answer) does; None otherwise, with the
        reason logged."""
        source = props.get("chat_template")
        if not isinstance(source, str) or not source:
            log.info("%s: no chat template in /props; prompts go through /apply-template", name)
            return None
        try:
            local = cls(
                source,
                bos_token=str(props.get("bos_token") or ""),
                eos_token=str(props.get("eos_token") or ""),
            )
            for probe in PROBES:
                mine, theirs = local.render(probe), reference(probe)
                if mine != theirs:
                    log.info(
                        "%s: the chat template renders differently here (%r, llama-server %r); "
                        "prompts go through /apply-template",
                        name,
                        mine[:120],
                        (theirs or "")[:120],
                    )
                    return None
        except RENDER_ERRORS as exc:
            log.info(
                "%s: the chat template does not render here (%s); using /apply-template", name, exc
            )
            return None
        log.info("%s: the chat template renders here as llama-server renders it", name)
        return local


def plain_messages(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The messages of an /apply-template body that a local template can render: the body has
    messages only (no tools) and every content is a string; None otherwise."""
    if set(request) != {"messages"}:
        return None
    messages = request["messages"]
    if not isinstance(messages, list):
        return None
    for m in messages:
        if not isinstance(m, dict) or set(m) - {"role", "content"}:
            return None
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
    return messages
