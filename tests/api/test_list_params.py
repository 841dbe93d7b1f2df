"""List endpoints' query parameters (django-filter): checked strictly, refused with 400 naming the
parameter in the API's error format, and documented in /api/schema/."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("/api/credits/ledger?offset=null", "offset"),
        ("/api/credits/ledger?offset=-1", "offset"),
        ("/api/credits/ledger?limit=abc", "limit"),
        ("/api/credits/ledger?limit=0", "limit"),
        ("/api/credits/receipts?offset=1.5", "offset"),
        ("/api/admin/jobs?limit=-1", "limit"),
        ("/api/admin/events?limit=many", "limit"),
        ("/api/admin/nodes?state=SLEEPY", "state"),
        ("/api/admin/deployments?state=NOPE", "state"),
        ("/api/admin/jobs?since=yesterday", "since"),
        ("/api/admin/events?node=not-a-uuid", "node"),
        ("/api/credits/ledger?kind=NOPE", "kind"),
        ("/api/credits/receipts?job=42", "job"),
        ("/api/credits/ledger?account=", "account"),
        ("/api/admin/nodes?state=", "state"),
        ("/api/admin/events?node=%20", "node"),
    ],
)
def test_a_bad_list_parameter_is_refused_with_400_naming_it(
    client: Client, query: str, param: str
) -> None:
    resp = client.get(query, headers=OPERATOR)
    assert resp.status_code == 400, resp.content
    error = resp.json()["error"]
    assert error["code"] == "invalid" and param in error["fields"], error


def test_good_limit_and_offset_are_accepted(client: Client) -> None:
    page = client.get("/api/credits/ledger?limit=1&offset=0", headers=OPERATOR)
    assert page.status_code == 200 and set(page.json()) == {"count", "next", "previous", "results"}
    assert client.get("/api/admin/jobs?limit=0", headers=OPERATOR).json() == []
    assert (
        client.get("/api/admin/events?limit=5000", headers=OPERATOR).status_code == 200
    )  # capped, not refused


def test_a_job_filter_naming_an_unknown_node_is_404(client: Client) -> None:
    resp = client.get("/api/admin/jobs?node=no-such-box", headers=OPERATOR)
    assert resp.status_code == 404 and resp.json()["error"] == {
        "message": "unknown node 'no-such-box'",
        "code": "not_found",
    }


def _parameters(schema: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    return {
        p["name"]: p
        for p in schema["paths"][path]["get"].get("parameters", [])
        if p["in"] == "query"
    }


def test_the_schema_documents_each_list_endpoints_query_parameters(client: Client) -> None:
    schema = client.get("/api/schema/?format=json", headers=OPERATOR).json()
    expected = {
        "/api/admin/nodes": {"state", "name"},
        "/api/admin/deployments": {"state", "model"},
        "/api/admin/jobs": {"state", "model", "node", "since", "until", "limit"},
        "/api/admin/events": {
            "kind",
            "category",
            "node",
            "job",
            "deployment",
            "since",
            "until",
            "limit",
        },
        "/api/credits/ledger": {"account", "kind", "since", "until", "limit", "offset"},
        "/api/credits/receipts": {"account", "job", "node", "limit", "offset"},
    }
    for path, names in expected.items():
        assert set(_parameters(schema, path)) == names, path
    ledger = _parameters(schema, "/api/credits/ledger")
    assert ledger["limit"]["schema"] == {"type": "integer", "minimum": 1}
    assert ledger["offset"]["schema"] == {"type": "integer", "minimum": 0}
    assert ledger["since"]["schema"]["format"] == "date-time"
    assert "GRANT" in ledger["kind"]["schema"]["enum"]
    assert "READY" in _parameters(schema, "/api/admin/nodes")["state"]["schema"]["enum"]
    assert _parameters(schema, "/api/credits/receipts")["job"]["schema"]["format"] == "uuid"


@pytest.mark.django_db(transaction=True)
def test_a_time_with_an_offset_postgresql_refuses_is_read_in_utc_and_one_out_of_range_is_400(
    client: Client,
) -> None:
    # PostgreSQL accepts offsets up to ±15:59; Python up to ±23:59. Found by schemathesis.
    for path in ("/api/admin/jobs", "/api/admin/events", "/api/credits/ledger"):
        ok = client.get(path, {"since": "0114-10-17T19:44:35+21:13"}, headers=OPERATOR)
        assert ok.status_code == 200, (path, ok.content)
        bad = client.get(path, {"since": "0001-01-01T00:10:00+21:13"}, headers=OPERATOR)
        assert bad.status_code == 400 and "since" in bad.json()["error"]["fields"], (
            path,
            bad.content,
        )
