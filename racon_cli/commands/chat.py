"""`racon chat`: a conversation with a model, streamed token by token over /v1/chat/completions."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from ..client import Client
from .common import client, handled, out


@handled
def chat(
    model: Annotated[str, typer.Argument(help="Model name (see `racon models ls`).")],
    message: Annotated[
        list[str] | None,
        typer.Option("--message", "-m", help="Send this and exit (repeat for several turns)."),
    ] = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.7,
) -> None:
    """Chat with a model, streamed token by token (type /reset to start over, /exit or Ctrl-D to leave)."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = not message and sys.stdin.isatty()
    with client(timeout=300) as c:
        if interactive:
            out().print(
                f"Chatting with {model} at {c.url}. /reset starts over, /exit or Ctrl-D leaves."
            )
        for text in _turns(message, interactive):
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if system else []
                out().print("(conversation reset)")
                continue
            history.append({"role": "user", "content": text})
            answer = _stream_answer(
                c,
                {
                    "model": model,
                    "messages": history,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                },
            )
            history.append({"role": "assistant", "content": answer})


def _turns(messages: list[str] | None, interactive: bool) -> Iterator[str]:
    if messages:
        yield from messages
        return
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            if interactive:
                sys.stdout.write("\n")
            return
        if line.strip():
            yield line.strip()


def _stream_answer(c: Client, body: dict[str, Any]) -> str:
    parts: list[str] = []
    usage: dict[str, Any] = {}
    t0 = time.monotonic()
    first: float | None = None
    for chunk in c.stream_chat({**body, "stream_options": {"include_usage": True}}):
        if "_headers" in chunk:
            continue
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                first = first or time.monotonic()
                parts.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        usage = chunk.get("usage") or usage
    sys.stdout.write("\n")
    tokens = int(usage.get("completion_tokens") or len(parts))
    spent = time.monotonic() - (first or t0)
    sys.stderr.write(
        f"[{tokens} tokens, {(first - t0) * 1000 if first else 0:.0f} ms to first token, "
        f"{tokens / spent if spent > 0 else 0:.1f} tok/s]\n"
    )
    return "".join(parts)
