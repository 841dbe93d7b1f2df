"""Two real agents on loopback measure the link between them through each other's RPC tunnel
(echo pings and a timed bulk transfer), on joining and again on the periodic re-probe; the
controller stores the measurement with its age and `racon nodes links` prints it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from racon_cli.main import app

from .harness import run_controller, start_agent, stop_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_two_agents_measure_their_link_and_racon_nodes_links_prints_it(tmp_path: Path) -> None:
    # Low interval and age, as a test harness may set them (racon/settings.py reads both from env).
    with run_controller(
        tmp_path / "ctl", LINK_PROBE_INTERVAL_SECONDS="2", LINK_MAX_AGE_SECONDS="120"
    ) as ctl:
        token = ctl.post("/api/admin/tokens", {"label": "links", "max_uses": 2}).json()["token"]
        agents = [start_agent(ctl, token, name, tmp_path) for name in ("left", "right")]
        try:

            def both_ways() -> list[dict[str, Any]] | None:
                links = ctl.get("/api/admin/nodes/links").json()["links"]
                pairs = {(lk["source_name"], lk["target_name"]) for lk in links}
                return links if {("left", "right"), ("right", "left")} <= pairs else None

            links = wait_for(both_ways, 90, "links measured both ways")
            for lk in links:
                assert lk["rtt_method"] == "tunnel-echo", lk
                assert lk["bandwidth_method"] == "measured", lk  # the bulk transfer, not a NIC
                assert 0 < lk["rtt_ms"] < 100 and lk["bandwidth_mbps"] > 50, lk
                assert lk["expired"] is False and lk["age_seconds"] < 120

            # The periodic re-probe measures again: the measurement gets newer.
            first = {(lk["source"], lk["target"]): lk["measured_at"] for lk in links}

            def remeasured() -> bool:
                now = ctl.get("/api/admin/nodes/links").json()["links"]
                return any(
                    lk["measured_at"] > first.get((lk["source"], lk["target"]), "") for lk in now
                )

            wait_for(remeasured, 30, "a link measured again by the periodic re-probe")

            res = CliRunner().invoke(
                app,
                ["nodes", "links"],
                env={
                    "RACON_URL": ctl.url,
                    "RACON_API_KEY": ctl.api_key,
                    "RACON_CONFIG": str(tmp_path / "cli.json"),
                    "COLUMNS": "200",
                },
                catch_exceptions=False,
            )
            assert res.exit_code == 0, res.output
            row = next(ln for ln in res.stdout.splitlines() if ln.startswith("left"))
            cells = row.split()
            assert cells[1] == "right" and cells[4] == "measured", row
            assert float(cells[3].replace(",", "")) > 50, row
        finally:
            for a in agents:
                stop_agent(a)
