"""The node's lending policy form (owner or staff; refusals name the field; the policy is stored
and pushed to the agent as set_lending) and the earnings page (apps/api/ui_lending.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.protocol import node_queue_key
from apps.api.templatetags.racon_ui import credits
from apps.credits.models import Receipt
from apps.nodes.lending import node_lending_claim
from apps.nodes.models import Event, Node
from racon import ids
from racon.redis import get_redis
from tests.support.ui import HTMX, World

pytestmark = pytest.mark.django_db
GiB = 1024**3

GOOD = {
    "timezone": "Europe/Paris",
    "windows": "mon-fri 19:00-08:00\nsat,sun 00:00-24:00",
    "handoff": "finish",
    "idle_minutes": "10",
    "cpu_below": "25",
    "ram_gb": "4",
    "vram_gb": "",
    "threads": "2",
}


def _commands(node: Node) -> list[dict[str, Any]]:
    return [json.loads(c) for c in get_redis().lrange(node_queue_key(str(node.id)), 0, -1)]


def test_the_owner_sets_the_policy_it_is_stored_and_pushed_to_the_agent(
    contributor_client: Client, world: World, django_capture_on_commit_callbacks: Any
) -> None:
    node = world.own_node
    with django_capture_on_commit_callbacks(execute=True) as pushed:
        resp = contributor_client.post(f"/nodes/{node.id}/lending", GOOD, **HTMX)
    assert len(pushed) == 1  # the command is sent once the policy is committed
    assert resp.status_code == 200, resp.content
    body = resp.content.decode()
    assert 'id="lending-saved"' in body and "<html" not in body  # the htmx partial
    node.refresh_from_db()
    policy = node.lending["policy"]
    assert policy == {
        "timezone": "Europe/Paris",
        "windows": ["mon-fri 19:00-08:00", "sat,sun 00:00-24:00"],
        "idle_minutes": 10,
        "cpu_below": 25,
        "caps": {"ram_bytes": 4 * GiB, "vram_bytes": None, "threads": 2},
        "handoff": "finish",
    }
    assert node.lending["source"] == "owner" and node.lending["owner"]["by"] == "carl"
    assert Event.objects.filter(node=node, kind="LENDING_POLICY").exists()
    [command] = _commands(node)
    assert command["kind"] == "set_lending" and command["payload"] == {"lending": policy}
    # The form shows it back, sizes in GB, one window a line.
    page = contributor_client.get(f"/nodes/{node.id}/lending").content.decode()
    assert 'value="Europe/Paris"' in page and 'name="ram_gb" value="4"' in page
    assert "mon-fri 19:00-08:00\nsat,sun 00:00-24:00</textarea>" in page
    assert "not yet confirmed by the agent" in page


def test_the_agents_report_of_the_owners_policy_marks_it_adopted(
    contributor_client: Client, world: World
) -> None:
    node = world.own_node
    assert contributor_client.post(f"/nodes/{node.id}/lending", GOOD).status_code == 200
    node.refresh_from_db()
    # What the agent reports once set_lending applied it (LENDING_POLICY {"lending": wire}).
    node_lending_claim(
        node_id=ids.node_id(node.id), policy=node.lending["policy"], now=timezone.now()
    )
    node.refresh_from_db()
    assert node.lending["source"] == "owner" and node.lending["owner"]["adopted_at"]
    page = contributor_client.get(f"/nodes/{node.id}/lending").content.decode()
    assert "adopted by the agent" in page
    # A different policy from the agent (its own flags, after the owner's) is the agent's.
    node_lending_claim(node_id=ids.node_id(node.id), policy={"timezone": "UTC"}, now=timezone.now())
    node.refresh_from_db()
    assert node.lending["source"] == "agent"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"windows": "mon-fri 19:00-08:00\nevery night"}, "windows", "windows[1]"),
        ({"windows": "mon-fry 19:00-08:00"}, "windows", "unknown day"),
        ({"timezone": "Mars/Olympus"}, "timezone", "unknown time zone"),
        ({"ram_gb": "64"}, "ram_gb", "caps.ram_gb"),  # the node has 16 GB
        ({"vram_gb": "1"}, "vram_gb", "caps.vram_gb"),  # and no GPU
        ({"threads": "2.5"}, "threads", "caps.threads"),
        ({"threads": "99"}, "threads", "caps.threads"),  # 8 threads
        ({"cpu_below": "150"}, "cpu_below", "idle.cpu_below"),
        ({"idle_minutes": "soon"}, "idle_minutes", "idle.minutes"),
        ({"handoff": "drop"}, "handoff", "handoff"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored_or_sent(
    contributor_client: Client, world: World, change: dict[str, str], field: str, words: str
) -> None:
    node = world.own_node
    before = node.lending
    resp = contributor_client.post(f"/nodes/{node.id}/lending", {**GOOD, **change}, **HTMX)
    assert resp.status_code == 422
    body = resp.content.decode()
    assert f'data-field="{field}"' in body and words in body, body
    assert 'aria-invalid="true"' in body
    # The owner's input is shown back for correcting, not the stored policy.
    for value in change.values():
        assert value.split("\n")[-1] in body
    node.refresh_from_db()
    assert node.lending == before
    assert _commands(node) == []
    assert not Event.objects.filter(node=node, kind="LENDING_POLICY").exists()


def test_only_the_owner_or_staff_may_see_or_set_a_nodes_policy(
    contributor_client: Client, staff_client: Client, world: World
) -> None:
    theirs = world.staff_node
    assert contributor_client.get(f"/nodes/{theirs.id}/lending").status_code == 404
    assert contributor_client.post(f"/nodes/{theirs.id}/lending", GOOD).status_code == 404
    theirs.refresh_from_db()
    assert not (theirs.lending or {}).get("policy") and _commands(theirs) == []
    # Staff may set any node's (here the contributor's).
    resp = staff_client.post(f"/nodes/{world.own_node.id}/lending", {"windows": "09:00-17:00"})
    assert resp.status_code == 200 and "<html" in resp.content.decode()  # the full page
    world.own_node.refresh_from_db()
    assert world.own_node.lending["policy"]["windows"] == ["09:00-17:00"]
    assert world.own_node.lending["owner"]["by"] == "olga"


def test_an_empty_form_lends_fully_always(contributor_client: Client, world: World) -> None:
    node = world.own_node
    empty = {k: "" for k in GOOD}
    assert contributor_client.post(f"/nodes/{node.id}/lending", empty).status_code == 200
    node.refresh_from_db()
    assert node.lending["policy"]["windows"] == [] and node.lending["policy"]["caps"] == {
        "ram_bytes": None,
        "vram_bytes": None,
        "threads": None,
    }


def test_the_node_page_loads_the_lending_form(contributor_client: Client, world: World) -> None:
    body = contributor_client.get(f"/nodes/{world.own_node.id}/").content.decode()
    assert f'hx-get="/nodes/{world.own_node.id}/lending"' in body
    assert f'href="/credits/earnings/?node={world.own_node.id}"' in body


# --- earnings -------------------------------------------------------------------------------


def test_the_earnings_page_shows_per_node_and_day_credits_jobs_and_receipts(
    contributor_client: Client, world: World
) -> None:
    resp = contributor_client.get("/credits/earnings/")
    assert resp.status_code == 200
    body = resp.content.decode()
    own = world.own_receipt
    # The contributor's node served both jobs (a receipt for each), and nothing of ops-box shows.
    assert body.count('class="earning-row"') == 1
    assert "carls-laptop" in body and "ops-box" not in body
    assert 'id="jobs-total">2<' in body and 'id="receipts-total">2<' in body
    assert own.credits > 0
    total = sum(r.credits for r in Receipt.objects.filter(node=world.own_node))
    assert f'id="earned-total">{credits(total)}<' in body
    assert f"{own.issued_at:%Y-%m-%d}" in body


def test_the_earnings_page_filters_by_node_and_days_as_an_htmx_partial(
    staff_client: Client, world: World
) -> None:
    url = f"/credits/earnings/?account={world.own_node.account_id}&node={world.own_node.id}&days=7"
    resp = staff_client.get(url, **HTMX)
    assert resp.status_code == 200
    body = resp.content.decode()
    assert "<html" not in body and 'id="earnings-table"' in body and "carls-laptop" in body
    # Staff without an account chosen see their own account's nodes.
    own = staff_client.get("/credits/earnings/").content.decode()
    assert "ops-box" in own and "carls-laptop" not in own.split('id="earnings-table"')[1]


def test_the_earnings_page_refuses_bad_parameters_naming_them(
    contributor_client: Client, world: World
) -> None:
    resp = contributor_client.get("/credits/earnings/?days=12")
    assert resp.status_code == 400 and resp.content.decode().startswith("days:")
    resp = contributor_client.get("/credits/earnings/?node=nope")
    assert resp.status_code == 400 and resp.content.decode().startswith("node:")
    # Another account's node, or another account (only staff may pick one): 404.
    assert (
        contributor_client.get(f"/credits/earnings/?node={world.staff_node.id}").status_code == 404
    )
    other = contributor_client.get(f"/credits/earnings/?account={world.staff_node.account_id}")
    assert other.status_code == 404
    mine = contributor_client.get(f"/credits/earnings/?account={world.own_node.account_id}")
    assert mine.status_code == 200 and "carls-laptop" in mine.content.decode()
