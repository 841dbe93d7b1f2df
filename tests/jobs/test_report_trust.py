"""Reports only from a plan's members (issue 12): each test performs the attack over HTTP and
asserts the refusal, its reason in the API's error format, and that nothing stored changed."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.protocol import job_stream_key
from apps.accounts.models import Account
from apps.credits.models import EntryKind
from apps.credits.settlement import credit_reserve, credit_settle_job
from apps.jobs.models import Deployment, Job
from apps.jobs.states import DeploymentState, JobState
from apps.nodes.commands import command_send, command_wait
from apps.nodes.models import Event
from racon.redis import get_redis
from tests.factories import NodeFactory, deployment_for, funded_account, job_for

pytestmark = pytest.mark.django_db


def report(
    client: Client, node: Any, kind: str, payload: dict[str, Any], command_id: str | None = None
) -> Any:
    body = {"id": uuid.uuid4().hex, "kind": kind, "payload": payload, "command_id": command_id}
    return client.post(
        "/api/agent/reports",
        body,
        content_type="application/json",
        headers={"Authorization": f"Node {node.pk}:cred"},
    )


@pytest.fixture
def plan() -> dict[str, Any]:
    primary, worker, outsider = NodeFactory(), NodeFactory(), NodeFactory()
    dep = deployment_for([(primary, 16), (worker, 16)])
    consumer = funded_account(10_000_000)
    job = job_for(account=consumer, model=dep.model, deployment=dep, max_tokens=100)
    Job.objects.filter(pk=job.pk).update(
        state=JobState.RUNNING, placement={"primary": str(primary.pk)}
    )
    job.nodes.set([primary, worker])
    return {
        "primary": primary,
        "worker": worker,
        "outsider": outsider,
        "dep": dep,
        "job": job,
        "consumer": consumer,
    }


def test_job_finished_from_a_node_outside_the_plan_is_refused_and_the_job_keeps_running(
    client: Client, plan: dict[str, Any]
) -> None:
    resp = report(
        client,
        plan["outsider"],
        "job_finished",
        {"job_id": str(plan["job"].pk), "status": "completed", "completion_tokens": 2_000_000_000},
    )
    assert resp.status_code == 409, resp.content
    error = resp.json()["error"]
    assert (
        error["code"] == "not_plan_member"
        and "not the primary" in error["message"]
        and str(plan["job"].pk) in error["message"]
    )
    job = Job.objects.get(pk=plan["job"].pk)
    assert job.state == JobState.RUNNING and job.completion_tokens == 0
    refused = Event.objects.get(kind="REPORT_REFUSED")
    assert refused.node_id == plan["outsider"].pk and refused.data["code"] == "not_plan_member"


def test_job_finished_from_a_worker_of_the_plan_is_refused_only_the_primary_reports(
    client: Client, plan: dict[str, Any]
) -> None:
    resp = report(
        client,
        plan["worker"],
        "job_finished",
        {"job_id": str(plan["job"].pk), "status": "failed", "error": "forged"},
    )
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "not_plan_member"
    assert Job.objects.get(pk=plan["job"].pk).state == JobState.RUNNING


def test_the_primarys_forged_usage_is_billed_on_the_controllers_count_and_never_past_the_hold(
    client: Client, plan: dict[str, Any], settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.CREDITS_MICRO_PER_TOKEN = 1_000
    job = plan["job"]
    held = credit_reserve(
        account_id=plan["consumer"].pk,
        job_id=job.pk,
        max_tokens=100,
        model_price_permille=1000,
        now=timezone.now(),
    )
    r = get_redis()
    for seq in range(3):
        r.xadd(
            job_stream_key(str(job.pk), str(plan["primary"].pk)),
            {"seq": seq, "attempt": 1, "type": "chunk", "text": "x", "ids": "[1]", "n": 1},
        )
    with django_capture_on_commit_callbacks(execute=True):
        resp = report(
            client,
            plan["primary"],
            "job_finished",
            {
                "job_id": str(job.pk),
                "status": "completed",
                "prompt_tokens": 5,
                "completion_tokens": 2_000_000_000,
            },
        )
    assert resp.status_code == 202, resp.content
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and job.completion_tokens == 3
    entry = credit_settle_job(job_id=job.pk, now=timezone.now())
    assert entry.kind == EntryKind.SETTLE and entry.data["charged"] <= held
    assert Account.objects.get(pk=plan["consumer"].pk).balance >= 10_000_000 - held


def test_runtime_failed_for_another_nodes_deployment_is_refused_and_the_deployment_stays_ready(
    client: Client, plan: dict[str, Any]
) -> None:
    dep = plan["dep"]
    resp = report(
        client,
        plan["outsider"],
        "event",
        {"event": "RUNTIME_FAILED", "message": "forged", "data": {"deployment_id": str(dep.pk)}},
    )
    assert resp.status_code == 409, resp.content
    assert (
        resp.json()["error"]["code"] == "not_plan_member"
        and str(dep.pk) in resp.json()["error"]["message"]
    )
    assert Deployment.objects.get(pk=dep.pk).state == DeploymentState.READY
    assert Deployment.objects.count() == 1  # no replacement was placed
    assert not Event.objects.filter(kind="RUNTIME_FAILED").exists()
    assert Job.objects.get(pk=plan["job"].pk).state == JobState.RUNNING


def test_runtime_failed_from_the_plans_primary_still_fails_the_deployment(
    client: Client, plan: dict[str, Any]
) -> None:
    dep = plan["dep"]
    resp = report(
        client,
        plan["primary"],
        "event",
        {"event": "RUNTIME_FAILED", "message": "aborted", "data": {"deployment_id": str(dep.pk)}},
    )
    assert resp.status_code == 202, resp.content
    assert Deployment.objects.get(pk=dep.pk).state == DeploymentState.FAILED


def test_another_event_naming_a_foreign_deployment_is_kept_on_the_node_but_not_attached(
    client: Client, plan: dict[str, Any]
) -> None:
    resp = report(
        client,
        plan["outsider"],
        "event",
        {
            "event": "RPC_WORKER_FAILED",
            "message": "late",
            "data": {"deployment_id": str(plan["dep"].pk)},
        },
    )
    assert resp.status_code == 202
    event = Event.objects.get(kind="RPC_WORKER_FAILED")
    assert event.node_id == plan["outsider"].pk and event.deployment_id is None


def test_command_result_from_a_node_the_command_was_not_sent_to_is_refused_and_never_delivered(
    client: Client, plan: dict[str, Any]
) -> None:
    cid = command_send(node_id=plan["primary"].pk, kind="load_primary", payload={})
    assert get_redis().get(f"racon:cmd:{cid}:node") == str(plan["primary"].pk)
    assert get_redis().ttl(f"racon:cmd:{cid}:node") > 0
    resp = report(
        client, plan["outsider"], "command_result", {"ok": True, "path": "/evil"}, command_id=cid
    )
    assert resp.status_code == 409, resp.content
    assert (
        resp.json()["error"]["code"] == "not_command_node"
        and cid in resp.json()["error"]["message"]
    )
    assert command_wait(command_id=cid, timeout=1) is None
    # The node it was sent to is still heard.
    assert (
        report(client, plan["primary"], "command_result", {"ok": True}, command_id=cid).status_code
        == 202
    )
    assert command_wait(command_id=cid, timeout=1)["node_id"] == str(plan["primary"].pk)


def test_command_result_for_a_command_never_sent_is_refused(
    client: Client, plan: dict[str, Any]
) -> None:
    resp = report(
        client, plan["outsider"], "command_result", {"ok": True}, command_id="c-never-sent"
    )
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "unknown_command"
    assert get_redis().llen("racon:cmdresult:c-never-sent") == 0


def test_refusals_are_recorded_once_a_minute_per_node_and_reason(
    client: Client, plan: dict[str, Any]
) -> None:
    for _ in range(5):
        report(client, plan["outsider"], "command_result", {"ok": True}, command_id="c-x")
    assert Event.objects.filter(kind="REPORT_REFUSED").count() == 1


@pytest.mark.parametrize(
    "payload",
    [
        {"kind": "job_finished", "payload": {"job_id": "not-a-uuid", "status": "completed"}},
        {"kind": "job_finished", "payload": {"job_id": str(uuid.uuid4()), "status": "completed"}},
        {
            "kind": "event",
            "payload": {"event": "RUNTIME_FAILED", "data": {"deployment_id": "../x"}},
        },
        {"kind": "event", "payload": {"event": "X", "data": "not-an-object"}},
    ],
)
def test_malformed_or_unknown_ids_in_reports_get_400_not_500(
    client: Client, plan: dict[str, Any], payload: dict[str, Any]
) -> None:
    resp = report(client, plan["primary"], payload["kind"], payload["payload"])
    assert resp.status_code == 400, resp.content
    assert resp.json()["error"]["code"] == "invalid_report"


@pytest.mark.parametrize("header", ["Node not-a-uuid:cred", "Node :", "Node 1:2:3", "Bearer x"])
def test_reports_with_a_malformed_node_id_get_401_not_500(client: Client, header: str) -> None:
    body = json.dumps({"id": "r1", "kind": "event", "payload": {"event": "X"}})
    resp = client.post(
        "/api/agent/reports",
        body,
        content_type="application/json",
        headers={"Authorization": header},
    )
    assert resp.status_code == 401, resp.content
    assert resp.json()["error"]["message"]
