"""The per-minute rollup behind the web UI's charts: what it counts, per model and per node, and that
it is idempotent, catches up and forgets rows past the retention."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from agent.protocol import heartbeat_key
from apps.jobs.models import Job, JobAttempt, MinuteRollup
from apps.jobs.rollup import rollup_write
from apps.jobs.series import (
    series_layer_share,
    series_node_load,
    series_throughput,
    series_ttft,
)
from apps.jobs.states import JobState
from racon.redis import get_redis
from tests.factories import ModelFactory, NodeFactory, deployment_for, job_for

pytestmark = pytest.mark.django_db


def _finish(
    job: Job, *, tokens: int, at: Any, state: str = JobState.COMPLETED, ttft_ms: float = 100
) -> None:
    dep = job.deployment
    assert dep is not None
    Job.objects.filter(pk=job.pk).update(
        state=state,
        completion_tokens=tokens,
        prompt_tokens=5,
        queued_at=at - timedelta(seconds=1),
        first_token_at=at - timedelta(seconds=1) + timedelta(milliseconds=ttft_ms),
        finished_at=at,
        placement={
            "devices": [
                {
                    "node_id": d["node_id"],
                    "device": "CPU",
                    "layers": [d["layer_start"], d["layer_end"]],
                }
                for d in dep.plan["devices"]
            ]
        },
    )
    job.nodes.set(dep.nodes.all())


@pytest.fixture
def split() -> dict[str, Any]:
    a = NodeFactory(name="big-box")
    b = NodeFactory(name="small-box")
    model = ModelFactory(name="tiny-model")
    return {"a": a, "b": b, "model": model, "dep": deployment_for([(a, 20), (b, 10)], model=model)}


def test_jobs_are_counted_per_minute_for_the_pool_the_model_and_each_node(
    split: dict[str, Any],
) -> None:
    now = timezone.now().replace(second=30, microsecond=0)
    for i, tokens in enumerate((10, 20, 30)):
        job = job_for(account=None, model=split["model"], deployment=split["dep"])
        _finish(job, tokens=tokens, at=now - timedelta(seconds=i), ttft_ms=100 * (i + 1))
    failed = job_for(account=None, model=split["model"], deployment=split["dep"])
    _finish(failed, tokens=0, at=now - timedelta(minutes=1), state=JobState.FAILED)

    rollup_write(now=now, notify=False)

    by_model = series_throughput(by="model", window="hour", now=now)
    (line,) = by_model["lines"]
    assert line["label"] == "tiny-model"
    assert line["total_requests"] == 4 and line["total_tokens"] == 60
    assert sum(line["failed"]) == 1
    assert line["requests"][-1] == 3 and line["requests"][-2] == 1  # this minute, the one before
    assert line["tokens_per_s"][-1] == 1.0  # 60 tokens in a 60 s step
    by_node = {
        ln["label"]: ln for ln in series_throughput(by="node", window="hour", now=now)["lines"]
    }
    assert by_node["big-box"]["total_requests"] == 4 and by_node["small-box"]["total_tokens"] == 60
    pool = series_throughput(by="pool", window="hour", now=now)["lines"][0]
    assert pool["total_requests"] == 4
    p50, p95 = series_ttft(window="hour", now=now)["lines"]
    assert p50["values"][-1] == 200.0 and p95["values"][-1] == 300.0
    share = {ln["label"]: ln["share"] for ln in series_layer_share(window="hour", now=now)["lines"]}
    assert share == {"big-box": pytest.approx(66.7), "small-box": pytest.approx(33.3)}
    # The day view folds minutes into ten-minute steps with the same totals.
    day = series_throughput(by="model", window="day", now=now)["lines"][0]
    assert day["total_requests"] == 4 and len(day["requests"]) == 144


def test_a_rewrite_is_idempotent_and_counts_jobs_that_ended_since(split: dict[str, Any]) -> None:
    now = timezone.now().replace(second=10, microsecond=0)
    job = job_for(account=None, model=split["model"], deployment=split["dep"])
    _finish(job, tokens=7, at=now)
    rollup_write(now=now, notify=False)
    rollup_write(now=now, notify=False)
    assert MinuteRollup.objects.get(scope="pool").requests == 1
    later = job_for(account=None, model=split["model"], deployment=split["dep"])
    _finish(later, tokens=5, at=now + timedelta(seconds=20))
    call_command(
        "rollup_flush", stdout=open("/dev/null", "w")
    )  # the command's output is not the point
    row = MinuteRollup.objects.get(scope="pool", minute=now.replace(second=0))
    assert row.requests == 2 and row.completion_tokens == 12


def test_a_failed_over_job_pays_each_attempts_nodes_for_their_tokens(split: dict[str, Any]) -> None:
    now = timezone.now().replace(second=20, microsecond=0)
    solo = NodeFactory(name="rescue-box")
    other = deployment_for([(solo, 30)], model=split["model"])
    job = job_for(account=None, model=split["model"], deployment=other)
    _finish(job, tokens=12, at=now)
    job.nodes.set([split["a"], split["b"], solo])
    JobAttempt.objects.create(
        job=job,
        number=1,
        deployment=split["dep"],
        plan=split["dep"].plan,
        started_at=now,
        completion_tokens=4,
        outcome="primary_died",
    )
    JobAttempt.objects.create(
        job=job,
        number=2,
        deployment=other,
        plan=other.plan,
        started_at=now,
        completion_tokens=8,
        outcome="COMPLETED",
    )
    rollup_write(now=now, notify=False)
    tokens = {
        ln["label"]: ln["total_tokens"]
        for ln in series_throughput(by="node", window="hour", now=now)["lines"]
    }
    assert tokens == {"big-box": 4, "small-box": 4, "rescue-box": 8}


def test_node_telemetry_is_sampled_and_old_rows_are_swept(
    split: dict[str, Any], settings: Any
) -> None:
    now = timezone.now()
    a = split["a"]
    a.ram_total = 8 * 2**30
    a.save(update_fields=["ram_total"])
    get_redis().hset(
        heartbeat_key(str(a.id)),
        "telemetry",
        json.dumps({"cpu_percent": 42.0, "mem_available": 6 * 2**30}),
    )
    MinuteRollup.objects.create(minute=now - timedelta(hours=49), scope="pool", requests=3)
    settings.ROLLUP_RETENTION_HOURS = 48
    got = rollup_write(now=now, notify=False)
    assert (
        got["swept"] == 1
        and not MinuteRollup.objects.filter(minute__lt=now - timedelta(hours=48)).exists()
    )
    cpu, mem = series_node_load(node_id=a.id, window="hour", now=now)["lines"]
    assert cpu["values"][-1] == 42.0 and mem["values"][-1] == 2.0
