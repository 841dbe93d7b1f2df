"""A primary cannot set its own bill through its stream (trust, second round: billing).

The controller is real (daphne, the /v1 view, admission, the stream follower, settlement); the
hostile node writes its job streams through the agent's own stream writer
(agent/runtime/stream.DirectStreamWriter, the same transaction the real agent uses), with the
entries it chooses: a forged ``n``, or more tokens than the job's ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.protocol import job_cancel_key
from agent.runtime.stream import DirectStreamWriter
from apps.jobs.models import Deployment, Job
from apps.jobs.states import JobState
from racon.redis import get_redis
from tests.factories import live_deployment

from .hostile import HostilePrimary, done, forged, post
from .live import Daphne, run_daphne

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def daphne(tmp_path: Path) -> Iterator[Daphne]:
    with run_daphne(tmp_path, API_CACHE_SECONDS="300") as d:
        yield d


@pytest.fixture
def dep() -> Deployment:
    return live_deployment()


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for block in resp.text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[6:]))
    return out


def test_a_chunks_count_is_its_ids_not_the_n_the_node_claims(
    daphne: Daphne, dep: Deployment
) -> None:
    def script(w: DirectStreamWriter) -> None:
        forged(w, "Hello", [9906], n="1000000")
        forged(w, " there", [1080], n="1000000")
        done(w, "stop", 2000000)

    with HostilePrimary(str(dep.primary_id), script):
        resp = post(daphne, max_tokens=16)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["text"] == "Hello there"
    assert body["usage"]["completion_tokens"] == 2, body["usage"]
    job = Job.objects.get()
    assert job.state == JobState.COMPLETED
    assert job.completion_tokens == 2


def test_a_stream_ends_at_max_tokens_with_length_whatever_the_primary_sends(
    daphne: Daphne, dep: Deployment
) -> None:
    def script(w: DirectStreamWriter) -> None:
        # Coalesced chunks with each token's share of the text; 7 tokens for a job of 4.
        forged(w, "Hello wor", [1, 2, 3], lens="[3,2,4]")
        forged(w, "ld! More", [4, 5, 6], lens="[2,1,5]")
        forged(w, " text", [7])
        done(w, "stop", 7)

    with HostilePrimary(str(dep.primary_id), script) as primary:
        resp = post(daphne, max_tokens=4, stream=True, stream_options={"include_usage": True})
        assert resp.status_code == 200, resp.text
        events = sse_events(resp)
        text = "".join(c["text"] for e in events for c in e.get("choices") or [])
        finishes = [
            c["finish_reason"] for e in events for c in e.get("choices") or [] if c["finish_reason"]
        ]
        assert text == "Hello world"  # cut on the fourth token's boundary
        assert finishes == ["length"]
        assert events[-1]["usage"]["completion_tokens"] == 4
        job = Job.objects.get()
        assert job.completion_tokens == 4
        # The primary is told to stop.
        assert get_redis().exists(job_cancel_key(primary.jobs[0], str(dep.primary_id)))

    # An honest primary that stops at max_tokens is not cut, and its end reads length.
    def honest(w: DirectStreamWriter) -> None:
        forged(w, "Hello wor", [1, 2, 3], lens="[3,2,4]")
        forged(w, "ld", [4])
        done(w, "stop", 4)

    with HostilePrimary(str(dep.primary_id), honest) as primary:
        resp = post(daphne, max_tokens=4)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["text"] == "Hello world"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
        assert not get_redis().exists(job_cancel_key(primary.jobs[0], str(dep.primary_id)))
