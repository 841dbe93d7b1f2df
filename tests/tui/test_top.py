"""`racon top` (textual) driven by its pilot against a live controller."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from apps.jobs.models import Job
from apps.jobs.states import JobState
from apps.nodes.models import Node
from apps.nodes.states import NodeState
from racon_cli.top import Confirm, TopApp
from tests.e2e.harness import ROOT, Controller
from tests.factories import ModelFactory, NodeFactory, job_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
SHOTS = ROOT / "test-artifacts" / "screenshots"


async def until(
    pilot: Pilot[Any], check: Callable[[], Any], what: str, timeout: float = 15.0
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        await pilot.pause(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def cell(app: TopApp, table_id: str, row: str, col: str) -> str:
    table = app.query_one(f"#{table_id}", DataTable)
    try:
        return str(table.get_cell(row, col))
    except Exception:  # row not there yet
        return ""


def test_top_shows_nodes_and_drains_the_selected_one_after_confirmation(live: Controller) -> None:
    NodeFactory(name="alpha")
    beta = str(NodeFactory(name="beta").id)

    async def scenario() -> None:
        app = TopApp(url=live.url, key=live.api_key, interval=0.5)
        async with app.run_test(size=(160, 50)) as pilot:
            nodes = app.query_one("#nodes", DataTable)
            await until(pilot, lambda: nodes.row_count == 2, "both nodes in the table")
            assert cell(app, "nodes", beta, "state") == "READY"
            nodes.move_cursor(row=nodes.get_row_index(beta))
            await until(
                pilot,
                lambda: "beta" in str(app.query_one("#node-detail", Static).render()),
                "beta's telemetry panel",
            )

            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, Confirm), "the confirmation dialog")
            await pilot.press("n")  # declined: nothing happens
            await pilot.pause(0.8)
            assert cell(app, "nodes", beta, "state") == "READY"

            await pilot.press("d")
            await until(pilot, lambda: isinstance(app.screen, Confirm), "the confirmation dialog")
            SHOTS.mkdir(parents=True, exist_ok=True)
            app.save_screenshot(filename="top-confirm.svg", path=str(SHOTS))
            await pilot.press("y")
            await until(
                pilot,
                lambda: cell(app, "nodes", beta, "state") in ("DRAINING", "DRAINED"),
                "beta to show its drain",
            )

            app.save_screenshot(filename="top.svg", path=str(SHOTS))
            await pilot.press("u", "y")
            await until(
                pilot,
                lambda: cell(app, "nodes", beta, "state") == "READY",
                "beta to show READY again",
            )

    asyncio.run(scenario())
    assert Node.objects.get(pk=beta).state == NodeState.READY
    assert Node.objects.get(name="alpha").state == NodeState.READY


def test_top_cancels_the_selected_job_after_confirmation(live: Controller) -> None:
    model = ModelFactory(name="tiny")
    job = str(job_for(account=None, model=model, max_tokens=8).id)

    async def scenario() -> None:
        app = TopApp(url=live.url, key=live.api_key, interval=0.5)
        async with app.run_test(size=(160, 50)) as pilot:
            jobs = app.query_one("#jobs", DataTable)
            await until(pilot, lambda: jobs.row_count == 1, "the job in the table")
            assert cell(app, "jobs", job, "state") == "QUEUED"
            jobs.focus()
            await pilot.press("c")
            await until(pilot, lambda: isinstance(app.screen, Confirm), "the confirmation dialog")
            await pilot.press("y")
            await until(
                pilot,
                lambda: cell(app, "jobs", job, "state") == "CANCELLED",
                "the job to show CANCELLED",
            )

    asyncio.run(scenario())
    assert Job.objects.get(pk=job).state == JobState.CANCELLED


def test_top_reports_an_unreachable_controller_in_its_status_line() -> None:
    # A port held bound but not listening refuses every connection, and no one else can take it.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]

        async def scenario() -> str:
            app = TopApp(url=f"http://127.0.0.1:{port}", key="k", interval=0.5)
            async with app.run_test(size=(120, 40)) as pilot:
                await until(
                    pilot, lambda: app.last_error, "an error in the status line", timeout=30
                )
                return app.last_error

        assert "cannot refresh" in asyncio.run(scenario())
