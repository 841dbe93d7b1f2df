"""Through the real /v1 relay (daphne, admission, the stream follower): a job's stream is deleted
as soon as the request that follows it ends, and not while it follows, even when the primary's
job_finished report has already made the job terminal (issue 28 item 2)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from agent.protocol import job_stream_key
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


def gone_within(key: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not get_redis().exists(key):
            return True
        time.sleep(0.1)
    return False


def test_the_relays_stream_is_deleted_when_the_request_ends(
    daphne: Daphne, dep: Deployment
) -> None:
    def script(w: DirectStreamWriter) -> None:
        forged(w, "Hello", [1])
        forged(w, " world", [2])
        done(w, "stop", 2)

    with HostilePrimary(str(dep.primary_id), script) as primary:
        resp = post(daphne, max_tokens=8)
        assert resp.status_code == 200, resp.text
    job = Job.objects.get()
    assert job.state == JobState.COMPLETED
    # At the request's end (a generous bound for a loaded machine), not after a sweep's grace.
    assert gone_within(job_stream_key(primary.jobs[0], str(dep.primary_id)), 30)


def test_a_stream_still_followed_outlives_the_reports_finish(
    daphne: Daphne, dep: Deployment
) -> None:
    seen: dict[str, Any] = {}

    def script(w: DirectStreamWriter) -> None:
        forged(w, "Hello", [1])
        # The primary reports the job finished before its stream's end: the job is terminal,
        # while the relay still follows the stream.
        resp = httpx.post(
            daphne.url + "/api/agent/reports",
            json={
                "id": uuid.uuid4().hex,
                "kind": "job_finished",
                "payload": {"job_id": w.job_id, "status": "completed", "completion_tokens": 2},
            },
            headers={"Authorization": f"Node {dep.primary_id}:cred"},
            timeout=60,
        )
        seen["report"] = resp.status_code
        seen["state"] = Job.objects.get(pk=w.job_id).state
        seen["exists_after_report"] = get_redis().exists(w.key)
        connection.close()  # this thread's own connection, opened by the read above
        forged(w, " world", [2])
        done(w, "stop", 2)

    with HostilePrimary(str(dep.primary_id), script) as primary:
        resp = post(daphne, max_tokens=8)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "Hello world"
    assert seen == {"report": 202, "state": JobState.COMPLETED, "exists_after_report": 1}, seen
    assert gone_within(job_stream_key(primary.jobs[0], str(dep.primary_id)), 30)
