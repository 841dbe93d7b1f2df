"""Tools, structured output, logprobs and seed through the official OpenAI SDK (issue 15, items 2-4),
against a real agent serving the real SmolLM2, and langchain-openai driving a tool loop.

SmolLM2's template knows no tools: the agent describes them in the system message, and a forced
(required or named) call is grammar-constrained, so it is a valid call whatever the model would
say. One live cluster (one agent, one deployment) for the module; every test talks HTTP only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel

from .harness import AgentProc, Controller, start_agent, stop_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-agentic"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
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
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def cluster(
    controller: Controller, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAI]:
    tmp = tmp_path_factory.mktemp("agentic")
    models_dir = tmp / "models"
    models_dir.mkdir()
    try:
        os.link(model_path, models_dir / model_path.name)
    except OSError:
        shutil.copy(model_path, models_dir / model_path.name)
    agent: AgentProc | None = None
    dep_id = None
    try:
        tok = controller.post("/api/admin/tokens", {"label": "agentic"})
        assert tok.status_code == 201, tok.text
        agent = start_agent(controller, tok.json()["token"], "ag-a", tmp, models_dir=models_dir)
        wait_for(
            lambda: any(
                n["name"] == "ag-a" for n in controller.get("/api/admin/nodes?state=READY").json()
            ),
            90,
            "the agent READY",
        )
        created = controller.post("/api/admin/models", {"path": str(model_path), "name": MODEL})
        assert created.status_code == 201, created.text
        dep = controller.post(
            "/api/admin/deployments",
            {"model": MODEL, "nodes": ["ag-a"], "n_ctx": 2048, "n_parallel": 2},
        )
        assert dep.status_code == 202, dep.text
        dep_id = dep.json()["id"]

        def ready() -> bool:
            state = controller.get(f"/api/admin/deployments/{dep_id}").json()["state"]
            assert state != "FAILED", controller.get(f"/api/admin/deployments/{dep_id}").text
            return state == "READY"

        wait_for(ready, 180, "the deployment READY")
        yield OpenAI(base_url=controller.url + "/v1", api_key=controller.api_key, timeout=600)
    finally:
        if dep_id is not None:
            controller.post(f"/api/admin/deployments/{dep_id}/stop")
        if agent is not None:
            stop_agent(agent)


# The module's only database test. pytest-django sets up the test database (which the live
# controller uses) only for a session holding such a test, runs it before the others, and flushes
# after it: so it needs no cluster, whose rows would go with the flush.
@pytest.mark.django_db(transaction=True)
def test_the_bodies_the_sdk_and_langchain_send_pass_validation_in_process(client: Any) -> None:
    call = {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    body = {
        "model": "no-such-model",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_x", "content": "5"},
        ],
        "tools": [ADD],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "max_completion_tokens": 80,
        "n": 1,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True},
        },
    }
    resp = client.post(
        "/v1/chat/completions",
        body,
        content_type="application/json",
        headers={"Authorization": "Bearer test-operator-key"},
    )
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def _one_call(message: Any, name: str) -> dict[str, Any]:
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    return args


# --- tool calls -------------------------------------------------------------------------------------


def test_a_named_tool_choice_returns_a_valid_call_in_openais_shape(cluster: OpenAI) -> None:
    resp = cluster.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    args = _one_call(choice.message, "get_weather")
    assert isinstance(args["city"], str)


def test_required_tool_choice_calls_one_of_the_tools_even_at_temperature_one(
    cluster: OpenAI,
) -> None:
    for seed in (1, 2):
        resp = cluster.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Add 2 and 3."}],
            tools=[WEATHER, ADD],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        if call.function.name == "add":
            assert isinstance(args["a"], int) and isinstance(args["b"], int)
        else:
            assert call.function.name == "get_weather" and isinstance(args["city"], str)


def test_a_forced_call_streams_as_tool_call_deltas(cluster: OpenAI) -> None:
    stream = cluster.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.tool_calls:
                deltas.extend(c.delta.tool_calls)
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    (d,) = deltas
    assert d.index == 0 and d.id.startswith("call_") and d.type == "function"
    assert d.function.name == "get_weather"
    assert isinstance(json.loads(d.function.arguments)["city"], str)


def test_auto_tool_choice_returns_text_or_a_valid_call_streamed_or_not(cluster: OpenAI) -> None:
    resp = cluster.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60
    )
    choice = resp.choices[0]
    if choice.message.tool_calls:  # the model chose to call
        assert choice.finish_reason == "tool_calls"
        _one_call(choice.message, "get_weather")
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    stream = cluster.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60, stream=True
    )
    text, deltas, finish = "", [], None
    for c in stream:
        for ch in c.choices:
            text += ch.delta.content or ""
            deltas.extend(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    # Text, or whole calls (not both: the splitter holds a call's markup back from the text).
    if deltas:
        assert finish == "tool_calls" and "<tool_call>" not in text
        assert all(d.function.name == "get_weather" for d in deltas)
    else:
        assert finish in ("stop", "length") and text


def test_a_tool_result_round_trip_is_accepted_and_answered(cluster: OpenAI) -> None:
    first = cluster.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    call = first.choices[0].message.tool_calls[0]
    resp = cluster.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and not choice.message.tool_calls
    assert resp.usage is not None and resp.usage.prompt_tokens > 60  # the history was in it


# --- structured output ----------------------------------------------------------------------------


def test_parse_with_a_pydantic_model_returns_an_instance(cluster: OpenAI) -> None:
    parse = getattr(cluster.chat.completions, "parse", None) or cluster.beta.chat.completions.parse
    resp = parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    city = resp.choices[0].message.parsed
    assert isinstance(city, City)
    assert isinstance(city.population, int)


def test_json_object_output_is_a_json_object_streamed_or_not(cluster: OpenAI) -> None:
    ask = [{"role": "user", "content": 'Reply with the JSON object {"animal": "cat"}.'}]
    resp = cluster.chat.completions.create(
        model=MODEL,
        messages=ask,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
    assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    stream = cluster.chat.completions.create(
        model=MODEL,
        messages=ask,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text) == json.loads(resp.choices[0].message.content or "")


# --- logprobs, seed, stop ---------------------------------------------------------------------------


def test_logprobs_come_per_token_with_the_asked_alternatives_streamed_or_not(
    cluster: OpenAI,
) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
    }
    resp = cluster.chat.completions.create(**kw)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content
    assert len(lp.content) == resp.usage.completion_tokens
    assert "".join(t.token for t in lp.content) == resp.choices[0].message.content
    for t in lp.content:
        assert t.logprob <= 0 and bytes(t.bytes or []).decode(errors="replace")
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-6  # greedy: the top one is chosen
    streamed = [
        t
        for c in cluster.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert [t.token for t in streamed] == [t.token for t in lp.content]


def test_the_same_seed_gives_the_same_answer_at_temperature_one(cluster: OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "temperature": 1.0,
        "max_tokens": 24,
    }
    a = cluster.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = cluster.chat.completions.create(**kw, seed=1234).choices[0].message.content
    others = {
        cluster.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2, 3)
    }
    assert a == b
    assert others - {a}, "different seeds should not all give the seed-1234 answer"


def test_stop_ends_the_answer_before_the_stop_string(cluster: OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        "temperature": 0,
        "max_tokens": 60,
    }
    full = cluster.chat.completions.create(**kw).choices[0].message.content or ""
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    resp = cluster.chat.completions.create(**kw, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert stop not in (resp.choices[0].message.content or "")


# --- refusals over the wire --------------------------------------------------------------------------


def test_unsupported_parameters_and_embeddings_are_400s_naming_them(cluster: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        cluster.chat.completions.create(
            model=MODEL, messages=ASK, logit_bias={"1": 5}, max_tokens=4
        )
    assert exc.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as exc:
        cluster.embeddings.create(model=MODEL, input="hello")
    assert exc.value.body["code"] == "embeddings_not_supported"


# --- a framework: langchain-openai's bind_tools, a tool loop end to end ------------------------------


def test_langchain_bind_tools_drives_a_tool_loop_to_an_answer(
    cluster: OpenAI, controller: Controller
) -> None:
    calls: list[tuple[int, int]] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    llm = ChatOpenAI(
        model=MODEL,
        base_url=controller.url + "/v1",
        api_key=controller.api_key,
        temperature=0,
        max_tokens=80,
        timeout=600,
    )
    messages: list[Any] = [HumanMessage("What is 2 plus 3? Use the add tool.")]
    first = llm.bind_tools([add], tool_choice="add").invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "add"
    messages.append(first)
    for tc in first.tool_calls:
        messages.append(ToolMessage(str(add.invoke(tc["args"])), tool_call_id=tc["id"]))
    final = llm.bind_tools([add]).invoke(messages)
    assert calls and isinstance(final.content, str)
    assert final.content or final.tool_calls  # an answer, or another call: the loop goes on
    assert calls[0] == (first.tool_calls[0]["args"]["a"], first.tool_calls[0]["args"]["b"])
