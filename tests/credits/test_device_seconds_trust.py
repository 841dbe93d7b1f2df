"""Issue 28: the primary's device_seconds cannot take its RPC workers' pay.

The primary reports job_finished through the agent endpoint, as a node would; settlement bounds
each device's figure by the attempt's wall time as the controller saw it (dispatch to finish),
and each worker's from below by the primary's own figure per device.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.protocol import job_stream_key
from apps.credits.settlement import credit_reserve, credit_settle_job
from apps.jobs.models import Job
from apps.jobs.states import JobState
from racon import ids
from racon.redis import get_redis
from tests.factories import NodeFactory, deployment_for, funded_account, job_for

pytestmark = pytest.mark.django_db


def report(client: Client, node: Any, payload: dict[str, Any]) -> Any:
    body = {"id": uuid.uuid4().hex, "kind": "job_finished", "payload": payload}
    return client.post(
        "/api/agent/reports",
        body,
        content_type="application/json",
        headers={"Authorization": f"Node {node.pk}:cred"},
    )


def run_job(
    client: Client,
    settings: Any,
    capture: Any,
    device_seconds: dict[str, float] | None,
) -> dict[str, int]:
    """One job over a primary and a worker (16 layers each), finished by the primary's report;
    returns each node's share of the settlement, by role."""
    settings.CREDITS_MICRO_PER_TOKEN = 1_000
    primary, worker = NodeFactory(), NodeFactory()
    dep = deployment_for([(primary, 16), (worker, 16)])
    consumer = funded_account(10_000_000)
    job = job_for(account=consumer, model=dep.model, deployment=dep, max_tokens=100)
    now = timezone.now()
    # Dispatched two seconds ago, as the controller recorded it.
    Job.objects.filter(pk=job.pk).update(
        state=JobState.RUNNING,
        placement={"primary": str(primary.pk)},
        dispatched_at=now - timedelta(seconds=2),
    )
    job.nodes.set([primary, worker])
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=100,
        model_price_permille=1000,
        now=now,
    )
    r = get_redis()
    for seq in range(10):
        r.xadd(
            job_stream_key(str(job.pk), str(primary.pk)),
            {"seq": seq, "attempt": 1, "type": "chunk", "text": "x", "ids": "[1]", "n": 1},
        )
    claims = {
        role: seconds
        for role, seconds in (device_seconds or {}).items()
        if role in ("primary", "worker")
    }
    payload: dict[str, Any] = {
        "job_id": str(job.pk),
        "status": "completed",
        "prompt_tokens": 5,
        "completion_tokens": 10,
    }
    if claims:
        node_ids = {"primary": str(primary.pk), "worker": str(worker.pk)}
        payload["device_seconds"] = {node_ids[role]: s for role, s in claims.items()}
    with capture(execute=True):
        resp = report(client, primary, payload)
    assert resp.status_code == 202, resp.content
    entry = credit_settle_job(job_id=ids.job_id(job.pk), now=timezone.now())
    shares = entry.data["shares"]
    return {"primary": shares[str(primary.pk)], "worker": shares[str(worker.pk)]}


def test_device_seconds_1e9_for_itself_leaves_the_workers_share_unchanged(
    client: Client, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    honest = run_job(client, settings, django_capture_on_commit_callbacks, None)
    # The primary claims a billion seconds for itself, and for its worker any figure longer than
    # the attempt ran (an hour): before, the worker's weight was 3,600 against 10^9.
    forged = run_job(
        client,
        settings,
        django_capture_on_commit_callbacks,
        {"primary": 1e9, "worker": 3600.0},
    )
    assert honest["worker"] > 0
    assert forged == honest, (forged, honest)


def test_a_tiny_device_seconds_for_the_worker_leaves_its_share_unchanged(
    client: Client, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    honest = run_job(client, settings, django_capture_on_commit_callbacks, None)
    # The attack from below: the primary claims the attempt's whole time for itself and a
    # millisecond for its worker (before: the worker's weight was 1 ms against ~2,000 ms).
    forged = run_job(
        client,
        settings,
        django_capture_on_commit_callbacks,
        {"primary": 2.0, "worker": 0.001},
    )
    assert honest["worker"] > 0
    assert forged == honest, (forged, honest)
    # Leaving the worker out of the report takes nothing from it either.
    omitted = run_job(client, settings, django_capture_on_commit_callbacks, {"primary": 2.0})
    assert omitted == honest, (omitted, honest)
