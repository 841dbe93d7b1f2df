"""Live updates: the dashboard WebSocket pushes re-rendered rows when a node changes state, and the
placement preview draws a real model's layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from apps.api.consumers import DashboardConsumer
from apps.credits.ledger import account_for_user
from apps.nodes.services import node_transition
from apps.nodes.states import NodeState
from tests.factories import NodeFactory, UserFactory
from tests.support.ui import HTMX


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_socket_pushes_an_oob_row_when_a_node_changes_state() -> None:
    staff = UserFactory(username="watcher", is_staff=True)
    node = NodeFactory(name="flappy", state=NodeState.READY)
    stranger = UserFactory(username="stranger")
    account_for_user(user=stranger)

    async def scenario() -> tuple[str, bool]:
        watcher = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/ws/dashboard/")
        watcher.scope["user"] = staff
        other = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/ws/dashboard/")
        other.scope["user"] = stranger
        assert (await watcher.connect())[0] and (await other.connect())[0]
        try:
            await database_sync_to_async(node_transition)(
                node_id=node.id, to=NodeState.DRAINING, expected=NodeState.READY, now=timezone.now()
            )
            html = await watcher.receive_from(timeout=10)
            # The stranger's consumer renders nothing for a node that is not theirs, so sends nothing.
            silent = await other.receive_nothing(timeout=0.5)
            return html, silent
        finally:
            await watcher.disconnect()
            await other.disconnect()

    html, silent = async_to_sync(scenario)()
    assert f'<tr id="node-row-{node.id}"' in html and 'hx-swap-oob="true"' in html
    assert ">DRAINING<" in html and "flappy" in html
    assert silent


@pytest.mark.django_db(transaction=True)
def test_an_anonymous_socket_is_refused() -> None:
    from django.contrib.auth.models import AnonymousUser

    async def scenario() -> bool:
        ws = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/ws/dashboard/")
        ws.scope["user"] = AnonymousUser()
        connected, _ = await ws.connect()
        await ws.disconnect()
        return connected

    assert async_to_sync(scenario)() is False


@pytest.fixture
def smollm2(db: Any, settings: Any, tmp_path: Path) -> Any:
    from apps.models_repo.services import model_register_file
    from tests.e2e.harness import smollm2_path

    settings.MODEL_STORE_DIR = tmp_path / "store"
    return model_register_file(
        path=smollm2_path(), name="smollm2", copy_to_store=False, now=timezone.now()
    )


def test_the_placement_preview_draws_every_layer_with_the_prediction_and_explanation(
    smollm2: Any, world: Any, staff_client: Client
) -> None:
    # Fresh nodes: the world's own deployment already holds its nodes' RPC workers.
    a, b = NodeFactory(name="box-a"), NodeFactory(name="box-b")
    resp = staff_client.post(
        "/deployments/preview",
        {"model": "smollm2", "n_ctx": "1024", "nodes": [str(a.id), str(b.id)], "spread": "on"},
        **HTMX,
    )
    body = resp.content.decode()
    assert resp.status_code == 200, body
    assert body.lstrip().startswith('<div id="preview"')
    assert body.count('class="cell"') == smollm2.n_layer == 30
    assert "tok/s predicted" in body and 'class="explanation"' in body
    assert "box-a" in body and "box-b" in body  # spread over both pinned nodes
    assert str(a.id) not in body.split('class="explanation"')[1]  # reasons name nodes, not ids


def test_deploying_from_the_ui_creates_a_deployment_row(
    smollm2: Any, world: Any, staff_client: Client
) -> None:
    from apps.jobs.models import Deployment

    # The placement task is enqueued on commit, which never comes in this rolled-back test: the
    # deployment is recorded and nothing tries to load it.
    resp = staff_client.post("/deployments/", {"model": "smollm2", "n_ctx": "1024"}, **HTMX)
    body = resp.content.decode()
    assert resp.status_code == 200, body
    dep = Deployment.objects.filter(model__name="smollm2").get()
    assert f'id="dep-row-{dep.id}"' in body and "Deployment created" in body


def test_a_refused_placement_shows_the_reason(
    smollm2: Any, world: Any, staff_client: Client
) -> None:
    small = NodeFactory(name="small-box")
    resp = staff_client.post(
        "/deployments/preview",
        {"model": "smollm2", "n_ctx": "1048576", "nodes": [str(small.id)]},
        **HTMX,
    )
    body = resp.content.decode()
    assert resp.status_code == 422 and "Placement refused" in body and "unknown pinned" not in body
