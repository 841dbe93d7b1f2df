"""The stream follower against the real (test) Redis: order, gaps, failover, and its own counts."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync

from agent.protocol import job_stream_key
from apps.jobs import admission, streams
from apps.jobs.streams import StreamFailure, StreamFollower
from racon import ids
from racon.ids import DeploymentId, JobId, NodeId
from racon.redis import get_redis
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


NODE = "node-streams-test"


def write(job: str, *entries: dict[str, Any]) -> None:
    r = get_redis()
    for e in entries:
        r.xadd(
            job_stream_key(job, NODE),
            {k: (json.dumps(v) if isinstance(v, list | dict) else str(v)) for k, v in e.items()},
        )


def chunk(seq: int, text: str, ids: list[int] | None, attempt: int = 1) -> dict[str, Any]:
    e: dict[str, Any] = {"seq": seq, "attempt": attempt, "type": "chunk", "text": text}
    if ids is not None:
        e.update(ids=ids, n=len(ids))
    return e


def done(seq: int, usage: dict[str, Any], attempt: int = 1) -> dict[str, Any]:
    return {
        "seq": seq,
        "attempt": attempt,
        "type": "done",
        "text": "",
        "finish_reason": "stop",
        "usage": usage,
    }


def follow(f: StreamFollower) -> list[dict[str, str]]:
    async def run() -> list[dict[str, str]]:
        return [e async for e in f.entries()]

    return async_to_sync(run)()


def test_completion_tokens_are_the_ids_relayed_not_the_nodes_claim(
    caplog: pytest.LogCaptureFixture,
) -> None:
    write(
        "j1",
        chunk(0, "Hello", [1]),
        {**chunk(1, " wide world", [2, 3, 4]), "n": 1000},  # a forged n is not counted
        chunk(2, "!", None),
        done(3, {"prompt_tokens": 5, "completion_tokens": 500, "ttft_ms": 12.5}),
    )
    f = StreamFollower(
        node_id=NodeId(NODE), job_id=JobId("j1"), deployment_id=None, prompt_bound=100
    )
    got = follow(f)
    # Chunks read together are relayed as one (coalescing); each entry is still counted.
    assert [e["type"] for e in got] == ["chunk", "done"]
    assert got[0]["text"] == "Hello wide world!" and json.loads(got[0]["ids"]) == [1, 2, 3, 4]
    assert f.chunks == 3 and f.completion_tokens == 1 + 3 + 1  # text without ids counts one
    with caplog.at_level("WARNING", logger="racon.jobs.streams"):
        usage = f.usage(got[-1])
    assert (
        usage["completion_tokens"] == 5 and usage["prompt_tokens"] == 5 and usage["ttft_ms"] == 12.5
    )
    assert "reports 500 completion tokens" in caplog.text


def test_prompt_tokens_are_bounded_by_the_prompts_bytes() -> None:
    params = {"messages": [{"role": "user", "content": "héllo"}]}
    bound = streams.prompt_token_bound(kind="chat", params=params)
    assert (
        bound
        == streams.CHAT_TEMPLATE_TOKENS
        + len("héllo".encode())
        + len(b"user")
        + streams.CHAT_MESSAGE_TOKENS
    )
    assert (
        streams.prompt_token_bound(kind="completion", params={"prompt": "abc"})
        == 3 + streams.COMPLETION_TEMPLATE_TOKENS
    )
    usage = streams.billed_usage(
        completion_tokens=2, agent_usage={"prompt_tokens": 10**6}, prompt_bound=bound
    )
    assert usage["prompt_tokens"] == bound
    assert (
        streams.billed_usage(
            completion_tokens=2, agent_usage={"prompt_tokens": 9}, prompt_bound=bound
        )["prompt_tokens"]
        == 9
    )


def test_a_gap_in_seq_is_a_failure() -> None:
    write("j2", chunk(0, "a", [1]), chunk(2, "c", [3]))
    f = StreamFollower(node_id=NodeId(NODE), job_id=JobId("j2"), deployment_id=None)
    with pytest.raises(StreamFailure) as exc:
        follow(f)
    assert exc.value.code == "stream_gap"
    assert f.completion_tokens == 1


def test_a_failover_attempt_starts_its_seq_over_and_late_entries_of_the_old_one_are_ignored() -> (
    None
):
    write(
        "j3",
        chunk(0, "a", [1]),
        chunk(1, "b", [2]),
        chunk(0, "c", [3], attempt=2),
        chunk(2, "stale", [9]),
        chunk(1, "d", [4], attempt=2),
        done(2, {}, attempt=2),
    )
    f = StreamFollower(node_id=NodeId(NODE), job_id=JobId("j3"), deployment_id=None)
    got = follow(f)
    assert "".join(e["text"] for e in got if e["type"] == "chunk") == "abcd"
    assert f.completion_tokens == 4 and f.attempt == 2


def test_error_entries_are_told_apart_by_their_code() -> None:
    assert (
        streams.error_for_entry(
            {"type": "error", "text": "too big", "code": "context_length_exceeded"}
        ).code
        == "context_length_exceeded"
    )
    failure = streams.error_for_entry(
        {"type": "error", "text": "context length exceeded, whatever", "code": "runtime_error"}
    )
    assert failure.code == "runtime_error" and failure.during_execution
    # An agent from before the code field still gets its 400.
    assert (
        streams.error_for_entry({"type": "error", "text": "prompt exceeds the context length"}).code
        == "context_length_exceeded"
    )


def test_an_idle_stream_fails_after_the_idle_limit() -> None:
    f = StreamFollower(
        node_id=NodeId(NODE), job_id=JobId("silent"), deployment_id=None, idle_timeout=0.5
    )
    t0 = time.monotonic()
    with pytest.raises(StreamFailure) as exc:
        follow(f)
    assert exc.value.code == "primary_timeout"
    assert time.monotonic() - t0 < 30


def test_the_reader_renews_the_jobs_slot_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "SLOT_RENEW_SECONDS", 0.0)
    almost_expired = time.time() - admission.slot_lease_seconds() + 2
    assert admission.slot_try(
        deployment_id=DeploymentId("d1"), job_id=JobId("j4"), cap=1, now=almost_expired
    )
    write("j4", chunk(0, "a", [1]), done(1, {}))
    follow(
        StreamFollower(node_id=NodeId(NODE), job_id=JobId("j4"), deployment_id=DeploymentId("d1"))
    )
    assert (
        get_redis().zscore(admission.slots_key(DeploymentId("d1")), "j4")
        > time.time() + admission.slot_lease_seconds() - 10
    )


def test_the_sweeps_tally_counts_like_the_follower() -> None:
    write("j5", chunk(0, "ab", [1, 2]), chunk(1, "c", None), done(2, {"completion_tokens": 99}))
    assert streams.stream_tally(JobId("j5"), NodeId(NODE)) == (2, 3)


def test_a_nodes_finished_report_is_billed_on_the_controllers_count_of_its_stream(now: Any) -> None:
    from apps.jobs.jobs import job_finish_from_report
    from apps.jobs.models import Job
    from apps.jobs.states import JobState
    from apps.models_repo.models import Model

    model = Model.objects.create(name="report-model")
    primary = NodeFactory()
    job = Job.objects.create(
        model=model,
        state=JobState.RUNNING,
        queued_at=now,
        kind="completion",
        params={"prompt": "abc"},
        placement={"primary": str(primary.id)},
    )
    key = job_stream_key(str(job.id), str(primary.id))  # the primary's own prefix
    for e in (chunk(0, "x y", [1, 2]), done(1, {})):
        get_redis().xadd(
            key,
            {k: (json.dumps(v) if isinstance(v, list | dict) else str(v)) for k, v in e.items()},
        )
    job_finish_from_report(
        node_id=ids.node_id(primary.id),
        payload={
            "job_id": str(job.id),
            "status": "completed",
            "prompt_tokens": 10**6,
            "completion_tokens": 900,
            "finish_reason": "stop",
        },
        now=now,
    )
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED
    assert job.completion_tokens == 2 and job.stream_chunks == 1
    assert job.prompt_tokens == streams.prompt_token_bound(
        kind="completion", params={"prompt": "abc"}
    )
