"""GET /api/credits/earnings (credits.selectors.node_earnings): per node and UTC day, the credits
earned (ledger), the jobs served and the receipts, for the caller's own nodes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client

from apps.accounts.models import Account
from apps.credits.settlement import credit_standby_reward
from apps.nodes.models import Node
from tests.factories import (
    AccountFactory,
    NodeFactory,
    key_for,
)

GiB = 1024**3
pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.credits.urls")]


def _rows(client: Client, account: Account, query: str = "") -> list[dict[str, Any]]:
    resp = client.get(f"/api/credits/earnings{query}", **key_for(account))
    assert resp.status_code == 200, resp.content
    return list(resp.json())


def test_earnings_are_per_node_and_day_newest_first(client: Client, earned: dict[str, Any]) -> None:
    rows = _rows(client, earned["owner"])
    today = earned["now"].date().isoformat()
    three = (earned["now"] - timedelta(days=3)).date().isoformat()
    got = [(r["day"], r["node_name"], r["credits"], r["jobs"], r["receipts"]) for r in rows]
    # 60 tokens × 1000 µ per job, no fee: 10% to the primary (own-a), the rest split over the
    # three nodes' equal layers: 24,000 to own-a and 18,000 to own-b per job. The 40-day-old
    # job is outside the default 30 days; the stranger's node is not listed.
    assert got == [
        (today, "own-b", 36_000, 2, 2),
        (today, "own-a", 48_000, 2, 2),
        (three, "own-b", 18_000, 1, 1),
        (three, "own-a", 24_000, 1, 1),
    ]
    assert {r["node"] for r in rows} == {str(earned["a"].id), str(earned["b"].id)}


def test_standby_pay_counts_towards_the_nodes_day(client: Client, settings: Any, now: Any) -> None:
    settings.CREDITS_STANDBY_PER_GIB_HOUR = 1_000
    settings.CREDITS_STANDBY_PERIOD_SECONDS = 600
    settings.CREDITS_ESCROW_ENABLED = False
    settings.CREDITS_STANDBY_UNSEEN_BYTES = -1
    settings.CREDITS_STANDBY_CAP_PER_PERIOD = 0
    owner = AccountFactory()
    node = NodeFactory(
        name="lender",
        account=owner,
        ram_available=8 * GiB,
        state_changed_at=now - timedelta(hours=2),
    )
    assert credit_standby_reward(now=now)
    # 8 GiB × 1000 µ/GiB·h × 10 minutes; no job, so no receipt.
    assert _rows(client, owner) == [
        {
            "node": str(node.id),
            "node_name": "lender",
            "day": now.date().isoformat(),
            "credits": 1_333,
            "jobs": 0,
            "receipts": 0,
        }
    ]


def test_earnings_days_and_node_filters(client: Client, earned: dict[str, Any]) -> None:
    owner = earned["owner"]
    assert len(_rows(client, owner, "?days=2")) == 2  # today only, both nodes
    assert len(_rows(client, owner, "?days=60")) == 6  # the 40-day-old day too
    only_a = _rows(client, owner, f"?node={earned['a'].id}&days=60")
    assert {r["node_name"] for r in only_a} == {"own-a"} and len(only_a) == 3
    # Another account's node: nothing of it is shown to this owner.
    assert _rows(client, owner, f"?node={earned['other'].id}") == []
    theirs = _rows(client, earned["stranger"])
    assert {r["node_name"] for r in theirs} == {"strangers"}


@pytest.mark.parametrize(
    ("query", "field"),
    [("?days=0", "days"), ("?days=367", "days"), ("?days=week", "days"), ("?node=x", "node")],
)
def test_bad_earnings_parameters_are_refused_naming_the_field(
    client: Client, earned: dict[str, Any], query: str, field: str
) -> None:
    resp = client.get(f"/api/credits/earnings{query}", **key_for(earned["owner"]))
    assert resp.status_code == 400
    assert field in resp.json()["error"]["fields"], resp.content


def test_earnings_need_an_account(client: Client, earned: dict[str, Any]) -> None:
    assert client.get("/api/credits/earnings").status_code in (401, 403)


def test_a_node_with_nothing_settled_has_no_rows(client: Client, price: Any) -> None:
    owner = AccountFactory()
    idle: Node = NodeFactory(account=owner)
    assert _rows(client, owner, f"?node={idle.id}") == []
