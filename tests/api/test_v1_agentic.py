"""Tools, structured output and logprobs at the /v1 boundary: the parsing and shaping functions
(pure), the agent's prompt shaping for templates without tools, and the 400s for parameters
RACoN does not honour (in-process; the live SDK tests are tests/e2e/test_agentic.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from agent.commands import CommandError, validate_job
from agent.runtime.prompting import plain_history, template_request, token_probs
from agent.runtime.server import _completion_body
from apps.api.errors import ApiError
from apps.api.v1 import agentic
from apps.api.v1.serializers import ChatCompletionIn, validate
from apps.api.v1.serializers import agentic as agentic_params
from apps.jobs.streams import prompt_token_bound
from tests.support.openai_api import AUTH, assert_openai_error, post

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    },
}
NAMES = {"get_weather", "add"}
USER = [{"role": "user", "content": "hi"}]


# --- tool modes and the forced call's schema -----------------------------------------------------


def test_tool_mode_is_auto_by_default_none_without_tools_and_forced_for_required_or_named() -> None:
    assert agentic.tool_mode(tools=None, tool_choice=None) == "none"
    assert agentic.tool_mode(tools=[WEATHER], tool_choice=None) == "auto"
    assert agentic.tool_mode(tools=[WEATHER], tool_choice="none") == "none"
    assert agentic.tool_mode(tools=[WEATHER], tool_choice="required") == "forced"
    named = {"type": "function", "function": {"name": "add"}}
    assert agentic.tool_mode(tools=[WEATHER], tool_choice=named) == "forced"


def test_a_named_choice_constrains_to_that_function_and_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "add"}}
    schema = agentic.forced_call_schema(tools=[WEATHER, ADD], tool_choice=named)
    assert schema["properties"]["name"] == {"const": "add"}
    assert schema["properties"]["arguments"] == ADD["function"]["parameters"]
    assert schema["required"] == ["name", "arguments"]


def test_required_allows_exactly_one_call_to_any_of_the_tools() -> None:
    schema = agentic.forced_call_schema(tools=[WEATHER, ADD], tool_choice="required")
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "add"]


# --- parsing ---------------------------------------------------------------------------------------


def _assert_call(call: dict[str, Any], name: str, args: dict[str, Any]) -> None:
    assert set(call) == {"id", "type", "function"}
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["type"] == "function"
    assert call["function"]["name"] == name
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == args


def test_a_forced_output_parses_into_one_call_with_arguments_as_a_json_string() -> None:
    content, calls = agentic.split_content(
        '{\n "name": "get_weather", "arguments": {"city": "Paris"}}',
        mode="forced",
        names=NAMES,
        parallel=True,
    )
    assert content is None
    (call,) = calls
    _assert_call(call, "get_weather", {"city": "Paris"})


def test_a_forced_output_cut_short_by_max_tokens_stays_text() -> None:
    content, calls = agentic.split_content(
        '{"name": "get_weather", "argu', mode="forced", names=NAMES, parallel=True
    )
    assert calls == [] and content == '{"name": "get_weather", "argu'


def test_auto_output_with_tool_call_blocks_gives_every_call_and_the_text_before_them() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    content, calls = agentic.split_content(text, mode="auto", names=NAMES, parallel=True)
    assert content == "Let me check."
    _assert_call(calls[0], "get_weather", {"city": "Paris"})
    _assert_call(calls[1], "add", {"a": 1, "b": 2})
    _, one = agentic.split_content(text, mode="auto", names=NAMES, parallel=False)
    assert len(one) == 1  # parallel_tool_calls: false keeps the first call only


def test_auto_output_as_bare_json_calls_parses_parameters_too() -> None:
    _, calls = agentic.split_content(
        '{"name": "add", "parameters": {"a": 1}}', mode="auto", names=NAMES, parallel=True
    )
    _assert_call(calls[0], "add", {"a": 1})


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"answer": 42}',  # JSON, but not a call
        '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
        "<tool_call>not json</tool_call>",
    ],
)
def test_auto_output_that_is_not_a_valid_call_to_a_known_function_stays_text(text: str) -> None:
    content, calls = agentic.split_content(text, mode="auto", names=NAMES, parallel=True)
    assert calls == [] and content == text


def test_the_splitter_streams_text_and_holds_from_a_marker_split_across_chunks() -> None:
    s = agentic.ToolCallSplitter(NAMES)
    sent = [s.feed(p) for p in ["Sure", ", one moment <tool", "_call>", '{"name": "add", ']]
    sent.append(s.feed('"arguments": {"a": 1}}</tool_call>'))
    assert "".join(sent) == "Sure, one moment "
    rest, calls = s.finish()
    assert rest == "" and calls[0]["function"]["name"] == "add"


def test_the_splitter_releases_a_lookalike_that_turns_out_to_be_text() -> None:
    s = agentic.ToolCallSplitter(NAMES)
    out = s.feed("a <tool") + s.feed("box> b")
    rest, calls = s.finish()
    assert out + rest == "a <toolbox> b" and calls == []
    s = agentic.ToolCallSplitter(NAMES)
    assert s.feed('{"not": "a call"}') == ""  # a JSON start is held to the end
    assert s.finish() == ('{"not": "a call"}', [])


def test_stream_deltas_carry_index_id_type_and_function() -> None:
    calls = [agentic.tool_call("add", {"a": 1}), agentic.tool_call("add", {"a": 2})]
    deltas = agentic.stream_tool_call_deltas(calls)
    assert [d["index"] for d in deltas] == [0, 1]
    assert all(set(d) == {"index", "id", "type", "function"} for d in deltas)


def test_logprobs_take_openais_chat_and_legacy_shapes() -> None:
    probs = [
        {"token": "He", "logprob": -0.1, "bytes": [72, 101], "top_logprobs": []},
        {
            "token": "llo",
            "logprob": -0.2,
            "bytes": [108, 108, 111],
            "top_logprobs": [{"token": "llo", "logprob": -0.2, "bytes": [108, 108, 111]}],
        },
    ]
    assert agentic.chat_logprobs(probs) == {"content": probs, "refusal": None}
    assert agentic.chat_logprobs(None) is None
    legacy = agentic.completion_logprobs(probs, offset=3)
    assert legacy == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{}, {"llo": -0.2}],
        "text_offset": [3, 5],
    }


# --- the request's parameters for the run -----------------------------------------------------------


def _params(body: dict[str, Any]) -> dict[str, Any]:
    return agentic_params(
        validate(ChatCompletionIn, {"model": "m", "messages": USER, **body}), kind="chat"
    )


def test_json_object_and_json_schema_become_the_runs_json_schema() -> None:
    assert _params({"response_format": {"type": "json_object"}})["json_schema"] == {
        "type": "object"
    }
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    rf = {"type": "json_schema", "json_schema": {"name": "X", "schema": schema, "strict": True}}
    assert _params({"response_format": rf})["json_schema"] == schema
    assert "json_schema" not in _params({"response_format": {"type": "text"}})


def test_a_forced_tool_choice_sets_the_calls_schema_and_parallel_defaults_true() -> None:
    p = _params({"tools": [WEATHER], "tool_choice": "required"})
    assert p["tool_mode"] == "forced" and p["parallel_tool_calls"] is True
    assert p["json_schema"]["properties"]["name"] == {"const": "get_weather"}
    p = _params({"tools": [WEATHER], "parallel_tool_calls": False})
    assert p["tool_mode"] == "auto" and p["parallel_tool_calls"] is False
    assert "json_schema" not in p


def test_logprobs_params_carry_the_number_of_alternatives() -> None:
    assert _params({"logprobs": True, "top_logprobs": 3}) | {} == {
        "logprobs": True,
        "top_logprobs": 3,
    }
    assert _params({"logprobs": True})["top_logprobs"] == 0
    assert _params({}) == {}


def test_tool_messages_and_assistant_tool_calls_validate_and_keep_their_ids() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    v = validate(
        ChatCompletionIn,
        {
            "model": "m",
            "tools": [WEATHER],
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        },
    )
    assert v["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert v["messages"][2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    # The prompt's bound counts the tools and the calls (a node's claim is checked against it).
    params = {"messages": v["messages"], "tools": v["tools"]}
    assert (
        prompt_token_bound(kind="chat", params=params)
        > prompt_token_bound(
            kind="chat",
            params={
                "messages": [{"role": m["role"], "content": m["content"]} for m in v["messages"]]
            },
        )
        + 256
    )


# --- 400s naming what RACoN does not honour ----------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_parameter"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_parameter"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
        (
            {"prediction": {"type": "content", "content": "x"}},
            "prediction",
            "unsupported_parameter",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"function_call": "auto"}, "function_call", "unsupported_parameter"),
        ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter"),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"n": 2}, "n", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "invalid_value",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"response_format": {"type": "yaml"}}, "response_format", "invalid_value"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0]",
            "invalid_value",
        ),
    ],
)
@pytest.mark.django_db
def test_a_parameter_racon_does_not_honour_gets_a_400_naming_it(
    client: Client, extra: dict[str, Any], param: str, code: str
) -> None:
    err = assert_openai_error(
        post(client, {"model": "nope", "messages": USER, **extra}), 400, code, param
    )
    assert param.split("[")[0] in err["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        {"parallel_tool_calls": False},  # without tools: nothing to do
        {"stream_options": {"include_usage": True}, "stream": True},
        {"logit_bias": {}, "modalities": ["text"], "functions": None, "n": 1},
        {"prompt_cache_key": "k", "safety_identifier": "s"},
    ],
)
@pytest.mark.django_db
def test_harmless_parameters_frameworks_send_are_accepted(
    client: Client, extra: dict[str, Any]
) -> None:
    # Accepted: validation passes and the request reaches model lookup (404: no such model).
    assert_openai_error(
        post(client, {"model": "nope", "messages": USER, **extra}), 404, "model_not_found"
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"tools": []}, "tools"),
    ],
)
@pytest.mark.django_db
def test_legacy_completions_refuse_what_they_do_not_honour(
    client: Client, extra: dict[str, Any], param: str
) -> None:
    resp = post(client, {"model": "nope", "prompt": "hi", **extra}, path="/v1/completions")
    assert_openai_error(
        resp, 400, "unsupported_parameter" if param != "tools" else "unknown_parameter", param
    )


def test_validate_refuses_before_the_serializer_runs() -> None:
    with pytest.raises(ApiError) as exc:
        validate(ChatCompletionIn, {"model": "m", "messages": USER, "logit_bias": {"1": 5}})
    assert exc.value.param == "logit_bias"


@pytest.mark.django_db
def test_embeddings_is_a_400_naming_why(client: Client) -> None:
    resp = client.post(
        "/v1/embeddings",
        {"model": "m", "input": "hi"},
        content_type="application/json",
        headers=AUTH,
    )
    err = assert_openai_error(resp, 400, "embeddings_not_supported", "model")
    assert "embedding" in err["message"]


# --- the agent's side: prompts for templates without tools, and the engine's request ----------------


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_in_words() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    job = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            *USER,
            {"role": "assistant", "content": "", "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        "tools": [ADD],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
    }
    msgs = template_request(job, template_has_tools=False)["messages"]
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.")
    assert '"name": "add"' in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert "You must call the function add now." in msgs[0]["content"]
    assert "at most one function" in msgs[0]["content"]
    assert msgs[2]["content"].count("<tool_call>") == 2
    assert json.loads(msgs[2]["content"].split("\n")[1]) == {"name": "add", "arguments": {"a": 1}}
    assert msgs[3] == {
        "role": "user",
        "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>",
    }
    assert len(msgs) == 4
    assert all(set(m) == {"role", "content"} for m in msgs)


def test_a_template_with_tools_renders_them_itself() -> None:
    job = {"messages": USER, "tools": [ADD], "tool_choice": "auto", "parallel_tool_calls": True}
    body = template_request(job, template_has_tools=True)
    assert body == {
        "messages": USER,
        "tools": [ADD],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }
    assert template_request({"messages": USER}, template_has_tools=False) == {"messages": USER}
    assert plain_history(USER) == USER


def test_the_engine_request_carries_the_schema_and_at_least_one_prob() -> None:
    job = validate_job(
        {
            "job_id": "j",
            "deployment_id": "d",
            "kind": "chat",
            "messages": USER,
            "json_schema": {"type": "object"},
            "logprobs": True,
            "top_logprobs": 0,
            "seed": 3,
        }
    )
    body = _completion_body(job, "prompt")
    assert body["json_schema"] == {"type": "object"}
    assert body["n_probs"] == 1 and body["seed"] == 3
    assert "n_probs" not in _completion_body(validate_job({**job, "logprobs": False}), "p")


def test_the_agent_refuses_malformed_agentic_fields() -> None:
    base = {"job_id": "j", "deployment_id": "d", "kind": "chat", "messages": USER}
    for bad in ({"tools": "x"}, {"json_schema": [1]}, {"top_logprobs": 99}, {"tool_choice": 5}):
        with pytest.raises(CommandError):
            validate_job({**base, **bad})


def test_engine_probs_become_openai_entries_with_at_most_top_alternatives() -> None:
    event = [
        {
            "id": 1,
            "token": "{",
            "bytes": [123],
            "logprob": -2.25,
            "top_logprobs": [
                {"id": 2, "token": "```", "bytes": [96, 96, 96], "logprob": -0.18},
                {"id": 1, "token": "{", "bytes": [123], "logprob": -2.25},
            ],
        }
    ]
    (entry,) = token_probs(event, 1)
    assert entry == {
        "token": "{",
        "logprob": -2.25,
        "bytes": [123],
        "top_logprobs": [{"token": "```", "logprob": -0.18, "bytes": [96, 96, 96]}],
    }
    assert token_probs(event, 0)[0]["top_logprobs"] == []
