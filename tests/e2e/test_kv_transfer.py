"""KV state transfer with real agents: when the replica holding a conversation drains, its slot's
state is saved, uploaded, downloaded by the other replica's agent and restored into one of its
slots; the conversation goes on there from the restored cache (no re-prefill) and, at
temperature 0, says what it said with no move."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from apps.jobs.retention import job_stream_entries
from racon.ids import JobId, NodeId

from .harness import (
    Controller,
    agents_serving_model,
    chat_ok,
    consumer_headers,
    replica_per_node,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-kvt"


def engine_usage(job_id: str, node_id: str) -> dict[str, Any]:
    """The agent's own usage report in the job's stream (``done`` entry): prompt_cached etc."""
    for _, fields in job_stream_entries(job_id=JobId(job_id), node_id=NodeId(node_id)):
        if fields.get("type") == "done":
            usage: dict[str, Any] = json.loads(fields.get("usage") or "{}")
            return usage
    raise AssertionError(f"job {job_id}: no done entry in its stream on node {node_id}")


def metric(text: str, name: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    assert lines, f"{name} missing from /metrics"
    return float(lines[0].split()[-1])


def test_a_drained_replicas_conversation_continues_from_its_moved_state(
    controller: Controller, model_path: Path, tmp_path: Path
) -> None:
    names = ("kvt-a", "kvt-b")
    with agents_serving_model(controller, model_path, tmp_path, names, MODEL) as (_, nodes):
        deps = replica_per_node(controller, MODEL, names, n_ctx=1024, n_parallel=2)
        node_of = {deps[name]: nodes[name]["id"] for name in deps}
        headers = consumer_headers("kvt-consumer")
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a terse assistant."}
        ]

        def ask(msgs: list[dict[str, str]]) -> tuple[str, str, dict[str, Any]]:
            """(reply, deployment, the engine's usage) for one chat at temperature 0."""
            body = {"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0}
            resp = chat_ok(controller, headers, body)
            dep_id = str(resp.headers["x-racon-deployment-id"])
            usage = engine_usage(str(resp.headers["x-racon-job-id"]), node_of[dep_id])
            return str(resp.json()["choices"][0]["message"]["content"]), dep_id, usage

        def turn(i: int) -> tuple[str, str, dict[str, Any]]:
            messages.append({"role": "user", "content": f"Turn {i}: name a colour and a number."})
            reply, dep_id, usage = ask(messages)
            messages.append({"role": "assistant", "content": reply})
            return reply, dep_id, usage

        _, owner, _ = turn(1)
        for i in (2, 3):
            assert turn(i)[1] == owner
        # The turn whose state will move, asked once with no move: its answer is the reference.
        messages.append({"role": "user", "content": "Turn 4: name a colour and a number."})
        asked = list(messages)
        reference, dep_id, usage = ask(asked)
        assert dep_id == owner
        assert int(usage.get("prompt_cached") or 0) > 0, usage  # a hit on the owner's slot

        other = next(d for d in deps.values() if d != owner)
        owner_node = next(n for n, d in deps.items() if d == owner)
        drained = controller.post(f"/api/admin/nodes/{nodes[owner_node]['id']}/drain")
        assert drained.status_code == 200, drained.text

        def state_moved() -> list[dict[str, Any]]:
            events = controller.get(f"/api/admin/deployments/{other}").json()["events"]
            return [e for e in events if e["kind"] == "KV_STATE_MOVED"]

        moved = wait_for(state_moved, 120, "KV_STATE_MOVED on the other replica")
        assert len(moved) == 1, moved
        data = moved[0]["data"]
        assert data["from_deployment"] == owner and data["to_deployment"] == other, data
        assert data["bytes"] > 0 and data["seconds"] > 0 and data["tokens"] > 0, data

        # The same turn again, now on the new owner: its prompt comes from the restored slot
        # (nearly every token cached, no re-prefill) and the answer is the no-move answer.
        again, dep_id, usage = ask(asked)
        assert dep_id == other
        cached = int(usage.get("prompt_cached") or 0)
        evaluated = int(usage.get("prompt_evaluated") or 0)
        assert cached > 0 and evaluated < cached, usage
        assert usage.get("id_slot") == data["to_slot"], (usage, data)
        assert again == reference, (again, reference)

        # The conversation goes on there.
        messages.append({"role": "assistant", "content": again})
        _, dep_id, usage = turn(5)
        assert dep_id == other
        assert int(usage.get("prompt_cached") or 0) > 0, usage

        metrics = controller.get("/metrics").text
        assert metric(metrics, "racon_kv_bytes_moved_total") >= data["bytes"]
        assert metric(metrics, "racon_kv_transfer_seconds_total") > 0
        # Moved, not dropped: the old replica stops with nothing left to drop.
        wait_for(
            lambda: controller.get(f"/api/admin/deployments/{owner}").json()["state"] == "STOPPED",
            120,
            "the drained replica STOPPED",
        )
        old_events = controller.get(f"/api/admin/deployments/{owner}").json()["events"]
        assert not any(e["kind"] == "KV_STATE_DROPPED" for e in old_events), old_events
