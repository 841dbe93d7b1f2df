from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.models import Account
from apps.credits import signing
from apps.credits.ledger import credit_grant
from apps.credits.models import Entry, EntryKind, Receipt
from apps.credits.settlement import credit_reserve, credit_settle_job
from racon import ids
from tests.factories import (
    AccountFactory,
    ModelFactory,
    NodeFactory,
    UserFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
    key_for,
)

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.credits.urls")]
OPERATOR: dict[str, Any] = {"HTTP_AUTHORIZATION": "Bearer test-operator-key"}


@pytest.fixture
def settled(price: Any, now: Any) -> dict[str, Any]:
    """A consumer, three owners and one settled job with three receipts."""
    owners = [AccountFactory() for _ in range(3)]
    nodes = [NodeFactory(account=o) for o in owners]
    model = ModelFactory()
    dep = deployment_for([(nodes[0], 10), (nodes[1], 10), (nodes[2], 10)], model=model)
    consumer = funded_account(1_000_000)
    job = job_for(account=consumer, model=model, deployment=dep, max_tokens=100)
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=100,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=60)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    return {"owners": owners, "nodes": nodes, "consumer": consumer, "job": job}


def test_balance_shows_the_callers_account(client: Client, settled: dict[str, Any]) -> None:
    resp = client.get("/api/credits/balance", **key_for(settled["consumer"]))
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["account"]["id"] == str(settled["consumer"].pk)
    assert body["balance"] == 940_000 and body["available"] == 940_000 and body["held"] == 0


def test_balance_counts_open_holds_and_earnings(
    client: Client, settled: dict[str, Any], now: Any
) -> None:
    consumer = settled["consumer"]
    job = job_for(account=consumer, model=settled["job"].model, max_tokens=10)
    credit_reserve(
        account_id=consumer.pk,
        job_id=ids.job_id(job.pk),
        max_tokens=10,
        model_price_permille=1000,
        now=now,
    )
    assert client.get("/api/credits/balance", **key_for(consumer)).json()["held"] == 10_000
    owner = client.get("/api/credits/balance", **key_for(settled["owners"][1])).json()
    assert owner["earned_total"] == 18_000 and owner["earned_recent"] == 18_000


def test_a_session_user_gets_their_own_account_with_the_starting_grant(
    client: Client, settings: Any
) -> None:
    settings.CREDITS_STARTING_GRANT = 123
    user = UserFactory()
    client.force_login(user)
    body = client.get("/api/credits/balance").json()
    assert body["balance"] == 123 and body["account"]["name"] == f"user:{user.username}"


def test_only_staff_may_look_at_another_account(client: Client, settled: dict[str, Any]) -> None:
    other = settled["owners"][0]
    resp = client.get(f"/api/credits/balance?account={other.pk}", **key_for(settled["consumer"]))
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "permission_denied"
    resp = client.get(f"/api/credits/balance?account={other.pk}", **OPERATOR)
    assert resp.status_code == 200 and resp.json()["account"]["id"] == str(other.pk)


def test_anonymous_callers_are_refused(client: Client) -> None:
    assert client.get("/api/credits/balance").status_code in (401, 403)
    assert client.get("/api/credits/ledger").status_code in (401, 403)


def test_ledger_is_paginated_and_filtered_by_kind_and_time(
    client: Client, settled: dict[str, Any]
) -> None:
    consumer = settled["consumer"]
    for i in range(3):
        credit_grant(account_id=consumer.pk, amount=1 + i, reason=f"bonus {i}", now=timezone.now())
    auth = key_for(consumer)
    page = client.get("/api/credits/ledger?limit=2", **auth).json()
    assert (
        page["count"] == 6 and len(page["results"]) == 2 and page["next"]
    )  # grant, reserve, settle + 3 grants
    assert page["results"][0]["memo"] == "bonus 2"
    grants = client.get("/api/credits/ledger?kind=GRANT", **auth).json()
    assert grants["count"] == 4 and {r["kind"] for r in grants["results"]} == {"GRANT"}
    settle = client.get("/api/credits/ledger?kind=SETTLE", **auth).json()["results"][0]
    assert settle["amount"] == 40_000 and settle["job"] == str(settled["job"].pk)
    future = (timezone.now() + timedelta(hours=1)).isoformat()
    assert client.get("/api/credits/ledger", {"since": future}, **auth).json()["count"] == 0
    assert client.get("/api/credits/ledger", {"until": future}, **auth).json()["count"] == 6


def test_ledger_rejects_bad_filters_in_the_admin_error_format(
    client: Client, settled: dict[str, Any]
) -> None:
    resp = client.get(
        "/api/credits/ledger?since=yesterday&kind=NOPE", **key_for(settled["consumer"])
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "invalid" and {"since", "kind"} <= set(err["fields"])


def test_receipts_list_the_callers_nodes_only_and_staff_see_all(
    client: Client, settled: dict[str, Any]
) -> None:
    owner = settled["owners"][2]
    mine = client.get("/api/credits/receipts", **key_for(owner)).json()
    assert mine["count"] == 1 and mine["results"][0]["node"] == str(settled["nodes"][2].pk)
    assert client.get("/api/credits/receipts", **key_for(settled["consumer"])).json()["count"] == 0
    everything = client.get(f"/api/credits/receipts?job={settled['job'].pk}", **OPERATOR).json()
    assert everything["count"] == 3
    by_node = client.get(f"/api/credits/receipts?node={settled['nodes'][0].pk}", **OPERATOR).json()
    assert by_node["count"] == 1


def test_one_receipt_is_visible_to_its_owner_and_hidden_from_others(
    client: Client, settled: dict[str, Any]
) -> None:
    receipt = Receipt.objects.get(node=settled["nodes"][0])
    url = f"/api/credits/receipts/{receipt.pk}"
    resp = client.get(url, **key_for(settled["owners"][0]))
    assert resp.status_code == 200 and resp.json()["document"]["signature"] == receipt.signature
    assert client.get(url, **key_for(settled["owners"][1])).status_code == 404
    assert client.get(url, **OPERATOR).status_code == 200


def test_verify_endpoint_accepts_a_real_receipt_and_rejects_a_tampered_one(
    client: Client, settled: dict[str, Any]
) -> None:
    doc = Receipt.objects.get(node=settled["nodes"][1]).document()
    ok = client.post(
        "/api/credits/receipts/verify", {"receipt": doc}, content_type="application/json"
    ).json()
    assert ok == {"valid": True, "reason": "ok"}
    bad = client.post(
        "/api/credits/receipts/verify",
        {"receipt": {**doc, "credits": doc["credits"] + 1}},
        content_type="application/json",
    ).json()
    assert bad["valid"] is False and "does not match" in bad["reason"]
    resp = client.post(
        "/api/credits/receipts/verify", {"receipt": "nope"}, content_type="application/json"
    )
    assert resp.status_code == 400


def test_public_key_endpoint_gives_a_key_that_verifies_receipts_offline(
    client: Client, settled: dict[str, Any]
) -> None:
    body = client.get("/api/credits/public-key").json()
    assert body["algorithm"] == "Ed25519" and body["pem"].startswith("-----BEGIN PUBLIC KEY-----")
    doc = Receipt.objects.get(node=settled["nodes"][0]).document()
    assert signing.receipt_verify(doc, body["public_key"]).valid
    assert signing.receipt_verify(doc, body["pem"]).valid
    assert doc["key_id"] == body["key_id"]


def test_staff_grant_writes_one_entry_with_the_reason(client: Client) -> None:
    acct = AccountFactory()
    body = {
        "account": str(acct.pk),
        "amount": 5_000,
        "reason": "hackathon prize",
        "idempotency_key": "prize-1",
    }
    resp = client.post(
        "/api/credits/admin/grant", body, content_type="application/json", **OPERATOR
    )
    assert resp.status_code == 201, resp.content
    assert resp.json()["account"]["balance"] == 5_000 and resp.json()["memo"] == "hackathon prize"
    again = client.post(
        "/api/credits/admin/grant", body, content_type="application/json", **OPERATOR
    )
    assert again.json()["entry_id"] == resp.json()["entry_id"]
    assert Account.objects.get(pk=acct.pk).balance == 5_000
    assert Entry.objects.filter(kind=EntryKind.GRANT, postings__account=acct).count() == 1


def test_grants_and_adjustments_are_staff_only(client: Client) -> None:
    acct = funded_account(10)
    body = {"account": str(acct.pk), "amount": 5, "reason": "self-service"}
    for url in ("/api/credits/admin/grant", "/api/credits/admin/adjust"):
        resp = client.post(url, body, content_type="application/json", **key_for(acct))
        assert resp.status_code == 403
    assert Account.objects.get(pk=acct.pk).balance == 10


def test_admin_adjust_goes_down_to_the_floor_and_refuses_below(client: Client) -> None:
    acct = funded_account(1_000)
    url = "/api/credits/admin/adjust"
    ok = client.post(
        url,
        {"account": str(acct.pk), "amount": -1_000, "reason": "clawback"},
        content_type="application/json",
        **OPERATOR,
    )
    assert ok.status_code == 201 and ok.json()["account"]["balance"] == 0
    below = client.post(
        url,
        {"account": str(acct.pk), "amount": -1, "reason": "more"},
        content_type="application/json",
        **OPERATOR,
    )
    assert below.status_code == 409 and below.json()["error"]["code"] == "insufficient_credits"


@pytest.mark.parametrize("amount", [0, -5, 2**62 + 1])
def test_admin_grant_refuses_zero_negative_and_overflowing_amounts(
    client: Client, amount: int
) -> None:
    acct = AccountFactory()
    resp = client.post(
        "/api/credits/admin/grant",
        {"account": str(acct.pk), "amount": amount, "reason": "x"},
        content_type="application/json",
        **OPERATOR,
    )
    assert resp.status_code == 400 and "amount" in resp.json()["error"]["fields"]
    assert Account.objects.get(pk=acct.pk).balance == 0


def test_admin_grant_to_an_unknown_account_is_404(client: Client) -> None:
    resp = client.post(
        "/api/credits/admin/grant",
        {"account": "00000000-0000-0000-0000-000000000001", "amount": 1, "reason": "x"},
        content_type="application/json",
        **OPERATOR,
    )
    assert resp.status_code == 404


def test_every_credits_endpoint_is_in_the_openapi_schema(client: Client) -> None:
    resp = client.get("/api/schema/?format=json", **OPERATOR)
    assert resp.status_code == 200
    paths = resp.json()["paths"]
    for p in (
        "balance",
        "ledger",
        "receipts",
        "receipts/{receipt_id}",
        "receipts/verify",
        "public-key",
        "admin/grant",
        "admin/adjust",
    ):
        assert f"/api/credits/{p}" in paths, p
