"""A job's stream leaves its node's prefix once the job is terminal, never while it is followed
(issue 28 item 2; apps/jobs/retention.py). The job ends by its primary's job_finished report,
sent to the agent endpoint as a node would; the follower is registered the way the /v1 relay and
the job page register theirs."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.protocol import job_stream_key
from apps.jobs import retention
from apps.jobs.models import Job
from apps.jobs.states import JobState
from racon import ids
from racon.redis import get_redis
from tests.factories import NodeFactory, deployment_for, funded_account, job_for

pytestmark = pytest.mark.django_db


def running_job_with_stream() -> tuple[Any, Any, str]:
    primary = NodeFactory()
    dep = deployment_for([(primary, 16)])
    job = job_for(account=funded_account(1_000_000), model=dep.model, deployment=dep)
    Job.objects.filter(pk=job.pk).update(
        state=JobState.RUNNING, dispatched_at=timezone.now() - timedelta(seconds=1)
    )
    key = job_stream_key(str(job.pk), str(primary.pk))
    r = get_redis()
    for seq in range(3):
        r.xadd(key, {"seq": seq, "attempt": 1, "type": "chunk", "text": "x", "ids": "[1]"})
    return job, primary, key


def finish_by_report(client: Client, capture: Any, job: Any, primary: Any) -> None:
    body = {
        "id": uuid.uuid4().hex,
        "kind": "job_finished",
        "payload": {"job_id": str(job.pk), "status": "completed", "completion_tokens": 3},
    }
    with capture(execute=True):
        resp = client.post(
            "/api/agent/reports",
            body,
            content_type="application/json",
            headers={"Authorization": f"Node {primary.pk}:cred"},
        )
    assert resp.status_code == 202, resp.content
    assert Job.objects.get(pk=job.pk).state == JobState.COMPLETED


def test_a_finished_jobs_stream_is_deleted_at_its_end_not_after_a_grace(
    client: Client, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.JOB_STREAM_KEEP_SECONDS = 3600  # the backstop sweep plays no part here
    job, primary, key = running_job_with_stream()
    finish_by_report(client, django_capture_on_commit_callbacks, job, primary)
    assert not get_redis().exists(key)


def test_a_released_jobs_entries_are_read_from_the_controllers_copy(
    client: Client, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.JOB_STREAM_KEEP_SECONDS = 3600
    job, primary, key = running_job_with_stream()
    before = retention.job_stream_entries(job_id=job.pk)
    assert [f["seq"] for _, f in before] == ["0", "1", "2"]
    finish_by_report(client, django_capture_on_commit_callbacks, job, primary)
    assert not get_redis().exists(key)  # the node's copy is gone; the reader finds the other
    assert retention.job_stream_entries(job_id=job.pk) == before
    assert retention.job_stream_entries(job_id=job.pk, node_id=primary.pk) == before
    assert retention.job_stream_entries(job_id=job.pk, node_id=ids.node_id(uuid.uuid4())) == []


def test_a_followed_stream_outlives_the_jobs_end_until_its_last_follower_stops(
    client: Client, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.JOB_STREAM_KEEP_SECONDS = 0  # nor does the sweep take a followed stream
    job, primary, key = running_job_with_stream()
    relay = retention.stream_follow_begin(job_id=job.pk)
    page = retention.stream_follow_begin(job_id=job.pk)
    finish_by_report(client, django_capture_on_commit_callbacks, job, primary)
    r = get_redis()
    assert r.exists(key)
    assert retention.job_streams_prune(now=timezone.now() + timedelta(seconds=5)) == 0
    assert r.exists(key)
    retention.stream_follow_end(job_id=job.pk, token=relay)
    assert r.exists(key)  # the page still follows
    retention.stream_follow_end(job_id=job.pk, token=page)
    assert not r.exists(key)


def test_a_follower_that_ends_before_the_job_leaves_the_stream_to_the_jobs_end(
    client: Client, django_capture_on_commit_callbacks: Any
) -> None:
    job, primary, key = running_job_with_stream()
    token = retention.stream_follow_begin(job_id=job.pk)
    retention.stream_follow_end(job_id=job.pk, token=token)
    assert get_redis().exists(key)  # the job still runs: its stream stays
    finish_by_report(client, django_capture_on_commit_callbacks, job, primary)
    assert not get_redis().exists(key)


def test_the_relays_end_releases_every_attempts_stream_it_saw_without_reading_the_job(
    django_assert_num_queries: Any,
) -> None:
    """serving.admission_finish records the end, then names the primaries its follower saw:
    each attempt's stream goes (archived), in no query, unless another follower remains."""
    job, primary, key = running_job_with_stream()
    other = NodeFactory()
    moved = job_stream_key(str(job.pk), str(other.pk))  # a failed-over attempt's stream
    r = get_redis()
    r.xadd(moved, {"seq": 0, "attempt": 2, "type": "chunk", "text": "y", "ids": "[2]"})
    relay = retention.stream_follow_begin(job_id=job.pk)
    page = retention.stream_follow_begin(job_id=job.pk)
    ended_on = [str(primary.pk), str(other.pk)]
    with django_assert_num_queries(0):
        assert retention.stream_follow_end(job_id=job.pk, token=relay, ended_on=ended_on) == 0
    assert r.exists(key) and r.exists(moved)  # the page still follows
    with django_assert_num_queries(0):
        assert retention.stream_follow_end(job_id=job.pk, token=page, ended_on=ended_on) == 2
    assert not r.exists(key) and not r.exists(moved)
    archived = [
        retention.job_stream_entries(job_id=job.pk, node_id=ids.node_id(n))
        for n in (primary.pk, other.pk)
    ]
    assert [[f["seq"] for _, f in e] for e in archived] == [["0", "1", "2"], ["0"]]
