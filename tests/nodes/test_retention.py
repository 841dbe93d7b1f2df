"""Retention (issue 28, item 2): event rows older than EVENT_RETENTION_DAYS are deleted by a beat
task, and a finished job's stream is deleted from its node's prefix once the job has been terminal
for JOB_STREAM_KEEP_SECONDS (never while it runs, never within that grace: a follower may still
be reading its end)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from agent.protocol import job_stream_key
from apps.jobs.models import Job
from apps.jobs.states import JobState
from apps.nodes.events import event_record
from apps.nodes.models import Event, EventCategory
from racon import ids
from racon.celery import task_send
from racon.redis import get_redis
from tests.factories import NodeFactory, deployment_for, funded_account, job_for

pytestmark = pytest.mark.django_db


def test_event_retention_is_at_least_the_longest_chart_and_in_the_beat_schedule() -> None:
    # The web UI's longest chart spans a day (apps/jobs/series.py); the events outlive it.
    assert django_settings.EVENT_RETENTION_DAYS >= 30
    tasks = {e["task"] for e in django_settings.CELERY_BEAT_SCHEDULE.values()}
    assert {"racon.nodes.events_prune", "racon.jobs.job_streams_prune"} <= tasks


def test_the_events_sweep_deletes_rows_past_the_retention_and_keeps_the_rest(
    settings: Any,
) -> None:
    settings.EVENT_RETENTION_DAYS = 30
    now = timezone.now()
    node = NodeFactory()
    for age in (31, 45, 29, 0):
        event_record(
            kind=f"AGE_{age}",
            category=EventCategory.RUNTIME,
            now=now - timedelta(days=age),
            node_id=ids.node_id(node.pk),
        )
    task_send("racon.nodes.events_prune")
    assert sorted(Event.objects.values_list("kind", flat=True)) == ["AGE_0", "AGE_29"]


def test_a_finished_jobs_stream_is_deleted_after_the_grace_and_a_running_ones_never(
    settings: Any,
) -> None:
    settings.JOB_STREAM_KEEP_SECONDS = 120
    primary = NodeFactory()
    dep = deployment_for([(primary, 16)])
    acct = funded_account(1_000_000)
    now = timezone.now()
    jobs = {}
    for name, state, ended in (
        ("old", JobState.COMPLETED, now - timedelta(minutes=10)),
        ("failed", JobState.FAILED, now - timedelta(minutes=5)),
        ("fresh", JobState.COMPLETED, now - timedelta(seconds=10)),
        ("running", JobState.RUNNING, None),
    ):
        job = job_for(account=acct, model=dep.model, deployment=dep, max_tokens=10)
        Job.objects.filter(pk=job.pk).update(state=state, finished_at=ended)
        key = job_stream_key(str(job.pk), str(primary.pk))
        get_redis().xadd(key, {"type": "token", "seq": 0, "text": "x"})
        jobs[name] = key
    task_send("racon.jobs.job_streams_prune")
    r = get_redis()
    assert {n: r.exists(k) for n, k in jobs.items()} == {
        "old": 0,
        "failed": 0,
        "fresh": 1,
        "running": 1,
    }
