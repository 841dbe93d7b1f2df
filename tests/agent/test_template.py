"""The chat template rendered in the agent (agent/runtime/template.py): trusted only when it
renders the probes as llama-server does, and used only for plain messages."""

from __future__ import annotations

from typing import Any

import pytest

from agent.runtime.template import PROBES, LocalTemplate, plain_messages

# SmolLM2's template as llama-server's /props gives it (the GGUF's tokenizer.chat_template).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] +"
    " '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROPS = {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def chatml(messages: list[dict[str, str]]) -> str:
    """llama-server's /apply-template output for CHATML (seen from the real server)."""
    out = ""
    if messages[0]["role"] != "system":
        out += "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def test_the_models_template_renders_as_llama_server_does() -> None:
    local = LocalTemplate.verified(PROPS, chatml, name="t")
    assert local is not None
    assert local.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Content is data, never template code.
    tricky = [{"role": "user", "content": "{{ 7 * 7 }} {% if x %}"}]
    assert local.render(tricky) == chatml(tricky)


def test_a_template_that_renders_otherwise_is_not_trusted() -> None:
    def off_by_a_space(messages: list[dict[str, str]]) -> str:
        return chatml(messages) + " "

    assert LocalTemplate.verified(PROPS, off_by_a_space, name="t") is None


def test_a_server_that_cannot_answer_leaves_the_round_trip() -> None:
    assert LocalTemplate.verified(PROPS, lambda messages: None, name="t") is None


@pytest.mark.parametrize(
    "props",
    [
        {},
        {"chat_template": ""},
        {"chat_template": "{{ raise_exception('no system role') }}"},
        {"chat_template": "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"},
        {"chat_template": "{% if %}"},
        {"chat_template": "{{ messages[0]['content'] + 1 }}"},  # a TypeError while rendering
    ],
)
def test_no_template_or_one_that_does_not_render_here_is_none(props: dict[str, Any]) -> None:
    assert LocalTemplate.verified(props, chatml, name="t") is None


def test_every_probe_is_checked() -> None:
    seen: list[list[dict[str, str]]] = []

    def reference(messages: list[dict[str, str]]) -> str:
        seen.append(messages)
        return chatml(messages)

    assert LocalTemplate.verified(PROPS, reference, name="t") is not None
    assert seen == list(PROBES)


def test_only_plain_string_messages_are_rendered_locally() -> None:
    plain = {"messages": [{"role": "user", "content": "Hi"}]}
    assert plain_messages(plain) == plain["messages"]
    assert plain_messages({**plain, "tools": [{"type": "function"}]}) is None
    assert plain_messages({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) is None
    assert (
        plain_messages({"messages": [{"role": "assistant", "content": "", "tool_calls": []}]})
        is None
    )
    assert (
        plain_messages({"messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}]})
        is None
    )
    assert plain_messages({"messages": "Hi"}) is None
