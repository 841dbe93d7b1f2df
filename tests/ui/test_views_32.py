"""Issue 32's pages without a browser: the event feed summarises and filters, failures read with their
cause and next step, the operator's machines and a contributor's own view, the account picker, and
charts that a contributor cannot point at someone else's node."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.api.ui_charts import ChartRefused, chart_payload
from apps.api.ui_failures import failure_explained
from apps.api.ui_render import viewer_for
from apps.credits.ledger import account_system
from apps.jobs.models import Deployment
from apps.jobs.rollup import rollup_write
from apps.jobs.states import DeploymentState
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory
from racon import ids
from tests.factories import NodeFactory, deployment_for, job_for
from tests.support.ui import HTMX, World

pytestmark = pytest.mark.django_db


def _flips(node: Any, n: int) -> None:
    now = timezone.now()
    for i in range(n):
        old, new = ("READY", "BUSY") if i % 2 == 0 else ("BUSY", "READY")
        event_record(
            kind="NODE_STATE_CHANGED",
            category=EventCategory.HEALTH,
            now=now + timedelta(milliseconds=i),
            node_id=node.id,
            old_state=old,
            new_state=new,
            message=f"{old} → {new}",
        )


def test_the_feed_sums_up_flips_and_job_events_and_names_everything(
    staff_client: Client, world: World
) -> None:
    _flips(world.staff_node, 6)
    now = timezone.now() + timedelta(seconds=1)
    for job in (world.staff_job, world.own_job):
        event_record(
            kind="JOB_DISPATCHED",
            category=EventCategory.EXECUTION,
            now=now,
            job_id=ids.job_id(job.id),
            deployment_id=ids.deployment_id(world.deployment.id),
            message=f"to deployment {world.deployment.id}",
        )
        event_record(
            kind="JOB_COMPLETED",
            category=EventCategory.EXECUTION,
            now=now,
            job_id=ids.job_id(job.id),
            message="20 tokens, stop",
        )
    body = staff_client.get("/events/").content.decode()
    assert body.count('data-kind="JOBS"') == 1  # four job events, one line
    assert "2 jobs completed · 40 tokens" in body and "tiny-model" in body
    assert body.count('data-kind="FLIPS"') == 1 and "went BUSY⇄READY 6 times · now READY" in body
    assert (
        f'href="/nodes/{world.staff_node.id}/"' in body
        and f'href="/jobs/{world.own_job.id}/"' in body
    )
    assert str(world.deployment.id) + "<" not in body  # never a bare id as text
    # Filters: by kind, by node.
    states = staff_client.get("/events/?kind=states", **HTMX).content.decode()
    assert 'data-kind="FLIPS"' in states and 'data-kind="JOBS"' not in states
    other = staff_client.get(f"/events/?node={world.own_node.name}", **HTMX).content.decode()
    assert 'data-kind="FLIPS"' not in other


def test_a_failed_deployment_collapses_and_names_its_cause_and_next_step(
    staff_client: Client, world: World
) -> None:
    failed = deployment_for([(world.staff_node, 30)])
    Deployment.objects.filter(pk=failed.pk).update(
        state=DeploymentState.FAILED,
        error="model transfer failed twice; file not used: fetch_model SmolLM2.gguf: HTTP 401 from http://10.0.0.5:8000",
    )
    body = staff_client.get("/deployments/").content.decode()
    assert 'id="dep-table" class="card flush hide-ended"' in body
    assert "Show 1 ended deployment (1 failed)" in body
    assert f'id="dep-row-{failed.id}" data-state="FAILED" data-ended="1"' in body
    assert "the node could not fetch the model: 401 from the controller" in body
    assert "HTTP 401 from http://10.0.0.5:8000" in body  # the full cause, one click away
    assert "check the node&#x27;s controller URL" in body
    assert f'<a href="/nodes/{world.staff_node.id}/"' in body


def test_failure_hints_fall_back_to_the_cause_and_a_generic_step() -> None:
    assert failure_explained("") is None
    odd = failure_explained("something nobody foresaw")
    assert (
        odd is not None and odd.cause == "something nobody foresaw" and "diagnose" in odd.next_step
    )


def test_the_account_picker_offers_people_and_the_operator_never_the_ledgers_accounts(
    staff_client: Client, world: World
) -> None:
    for name in ("system:escrow", "system:mint", "system:operator"):
        account_system(name=name)
    body = staff_client.get("/credits/").content.decode()
    picker = body[
        body.index('<select name="account"') : body.index(
            "</select>", body.index('<select name="account"')
        )
    ]
    assert "system:operator" in picker and "carl" in picker
    assert "system:escrow" not in picker and "system:mint" not in picker


def test_an_operators_earnings_include_the_machines_that_earn_into_the_operator_account(
    staff_client: Client, world: World
) -> None:
    operator = account_system(name="system:operator")
    NodeFactory(name="ops-rack", account=operator)
    body = staff_client.get("/credits/earnings/").content.decode()
    assert "ops-rack" in body and "ops-box" in body  # the operator account's node and their own


def test_a_contributor_sees_their_machines_what_they_served_and_their_standing(
    contributor_client: Client, world: World
) -> None:
    rollup_write(now=timezone.now(), notify=False)
    body = contributor_client.get("/").content.decode()
    assert 'id="my-machines"' in body and "carls-laptop" in body and "ops-box</a>" not in body
    assert "Standing in the queue" in body and "rank" in body
    assert "lent fully, always (no policy set)" in body
    assert 'data-chart-id="earnings"' in body and 'data-chart-id="requests-node"' in body
    assert 'data-chart-id="requests-model"' not in body  # per-model charts are the operator's


def test_a_contributor_cannot_chart_another_accounts_node(world: World) -> None:
    from django.http import Http404

    viewer = viewer_for(world.contributor)
    now = timezone.now()
    with pytest.raises(Http404):
        chart_payload(
            viewer=viewer, spec={"chart": "node_load", "node": str(world.staff_node.id)}, now=now
        )
    with pytest.raises(ChartRefused):
        chart_payload(viewer=viewer, spec={"chart": "throughput", "by": "model"}, now=now)
    own = chart_payload(
        viewer=viewer, spec={"chart": "throughput", "by": "node", "field": "requests"}, now=now
    )
    assert {ln["label"] for ln in own["lines"]} <= {"carls-laptop"}


def test_a_nodes_page_names_the_deployments_its_events_mention(
    staff_client: Client, world: World
) -> None:
    import re

    dep = world.deployment
    event_record(
        kind="PRIMARY_LOADED",
        category=EventCategory.RUNTIME,
        now=timezone.now(),
        node_id=ids.node_id(world.staff_node.id),
        deployment_id=ids.deployment_id(dep.id),
        message=f"deployment {dep.id} loaded (CPU: 31 layers)",
    )
    event_record(
        kind="DEPLOYMENT_READY",
        category=EventCategory.PLACEMENT,
        now=timezone.now(),
        node_id=ids.node_id(world.staff_node.id),
        message=f"deployment {dep.id} is READY",
    )
    body = staff_client.get(f"/nodes/{world.staff_node.id}/").content.decode()
    main = body[body.index("<main") : body.index("</main>")]
    main = re.sub(
        r"<script.*?</script>|<dd class=\"mono small\" data-raw-id>.*?</dd>|<[^>]+>",
        " ",
        main,
        flags=re.S,
    )
    assert str(dep.id) not in main, [m for m in re.findall(r".{60}" + str(dep.id), main)]
    assert "tiny-model deployment" in main


def test_a_contributors_feed_has_the_job_events_of_the_jobs_their_machine_served(
    contributor_client: Client, world: World
) -> None:
    now = timezone.now()
    # The operator's job, served by carl's laptop (among others): its events name no node.
    event_record(
        kind="JOB_COMPLETED",
        category=EventCategory.EXECUTION,
        now=now,
        job_id=ids.job_id(world.staff_job.id),
        message="20 tokens, stop",
    )
    elsewhere = job_for(account=world.staff_job.account, model=world.staff_job.model)
    elsewhere.nodes.set([world.staff_node])
    event_record(
        kind="JOB_FAILED",
        category=EventCategory.EXECUTION,
        now=now,
        job_id=ids.job_id(elsewhere.id),
        message="boom",
    )
    body = contributor_client.get("/events/").content.decode()
    assert f'href="/jobs/{world.staff_job.id}/"' in body
    assert f'href="/jobs/{elsewhere.id}/"' not in body and "ops-box" not in body


def test_a_failed_over_jobs_page_names_the_nodes_and_layers_of_each_attempt(
    staff_client: Client, world: World
) -> None:
    from apps.jobs.models import JobAttempt

    rescue = NodeFactory(name="rescue-box")
    other = deployment_for([(rescue, 30)])
    now = timezone.now()
    JobAttempt.objects.create(
        job=world.staff_job,
        number=1,
        deployment=world.deployment,
        plan=world.deployment.plan,
        started_at=now,
        completion_tokens=4,
        outcome="primary_died",
    )
    JobAttempt.objects.create(
        job=world.staff_job,
        number=2,
        deployment=other,
        plan=other.plan,
        started_at=now,
        completion_tokens=16,
        outcome="COMPLETED",
    )
    body = staff_client.get(
        f"/jobs/{world.staff_job.id}/", **HTMX
    ).content.decode()  # the playground's fragment
    assert body.lstrip().startswith('<section class="card" id="served-by">')
    assert "Attempt 1" in body and "primary_died" in body and "Attempt 2" in body
    for node in (world.staff_node, world.own_node, rescue):
        assert f'<a href="/nodes/{node.id}/">{node.name}</a>' in body
    assert "0–19" in body and "20–29" in body and "0–29" in body
