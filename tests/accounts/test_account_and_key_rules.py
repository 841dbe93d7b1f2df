"""The rules of POST /api/admin/accounts and POST /api/keys that the OpenAPI schema states (issue 12:
positive_data_acceptance) are the rules the views apply: the password's minimum length (from
AUTH_PASSWORD_VALIDATORS), a taken username as a 409 naming the field, keys as JSON only, and
expires_at or expires_in_days but not both. The one rule the schema can only say in words, a
future expires_at, is a 400 naming the field."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from apps.accounts import services
from apps.accounts.models import ApiKey

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


def _schema(client: Client) -> dict[str, Any]:
    resp = client.get("/api/schema/?format=json", headers=OPERATOR)
    assert resp.status_code == 200
    return resp.json()


def _component(schema: dict[str, Any], path: str) -> dict[str, Any]:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]


def _post(client: Client, path: str, body: Any) -> Any:
    return client.post(path, body, content_type="application/json", headers=OPERATOR)


def _password_branches(client: Client) -> list[dict[str, Any]]:
    password = _component(_schema(client), "/api/admin/accounts")["properties"]["password"]
    return password["oneOf"]


def test_the_schema_states_the_password_minimum_length_and_blank_for_an_invite(
    client: Client,
) -> None:
    branches = _password_branches(client)
    assert {"type": "string", "maxLength": 0} in branches  # blank: an invite
    (password,) = [b for b in branches if b.get("maxLength") != 0]
    assert password["minLength"] == services.password_min_length() == 8


def test_the_stated_minimum_follows_auth_password_validators(client: Client, settings: Any) -> None:
    settings.AUTH_PASSWORD_VALIDATORS = [
        {
            "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
            "OPTIONS": {"min_length": 12},
        }
    ]
    (password,) = [b for b in _password_branches(client) if b.get("maxLength") != 0]
    assert password["minLength"] == 12
    short = _post(client, "/api/admin/accounts", {"username": "ivy", "password": "x" * 11})
    assert short.status_code == 400 and "password" in short.json()["error"]["fields"]
    assert (
        _post(client, "/api/admin/accounts", {"username": "ivy", "password": "x" * 12}).status_code
        == 201
    )


def test_a_password_under_the_minimum_is_refused_naming_the_field_and_none_is_made(
    client: Client,
) -> None:
    resp = _post(client, "/api/admin/accounts", {"username": "dan", "password": "1234567"})
    assert resp.status_code == 400, resp.content
    assert "at least 8 characters" in resp.json()["error"]["fields"]["password"][0]
    assert not get_user_model().objects.filter(username="dan").exists()


def test_a_password_is_taken_as_sent_with_its_spaces(client: Client) -> None:
    """Spaces count towards the minimum and are part of the password (no trimming)."""
    resp = _post(client, "/api/admin/accounts", {"username": "eli", "password": "  pass  "})
    assert resp.status_code == 201, resp.content
    assert Client().login(username="eli", password="  pass  ")
    assert not Client().login(username="eli", password="pass")


def test_a_blank_password_is_an_invite(client: Client) -> None:
    resp = _post(client, "/api/admin/accounts", {"username": "fay", "password": ""})
    assert resp.status_code == 201, resp.content
    assert resp.json()["invite_pending"] and resp.json()["invite_url"]


def test_a_taken_username_is_a_409_naming_the_field_and_the_first_user_is_kept(
    client: Client,
) -> None:
    first = _post(
        client, "/api/admin/accounts", {"username": "gus", "password": "first passphrase"}
    )
    assert first.status_code == 201
    again = _post(
        client, "/api/admin/accounts", {"username": "gus", "password": "other passphrase"}
    )
    assert again.status_code == 409, again.content
    error = again.json()["error"]
    assert error["code"] == "username_taken" and list(error["fields"]) == ["username"]
    assert Client().login(username="gus", password="first passphrase")
    assert (
        "username_taken" in _schema(client)["paths"]["/api/admin/accounts"]["post"]["description"]
    )


def test_the_service_says_a_taken_username_as_its_own_error() -> None:
    services.account_user_create(username="hal")
    with pytest.raises(services.UsernameTaken, match="exists already"):
        services.account_user_create(username="hal", password="long enough passphrase")
    assert get_user_model().objects.filter(username="hal").count() == 1


def test_keys_take_json_only_so_a_null_expiry_can_be_sent(client: Client) -> None:
    schema = _schema(client)
    assert set(schema["paths"]["/api/keys"]["post"]["requestBody"]["content"]) == {
        "application/json"
    }
    assert "415" in schema["paths"]["/api/keys"]["post"]["responses"]
    form = client.post("/api/keys", {"name": "x", "expires_at": ""}, headers=OPERATOR)
    assert form.status_code == 415, form.content
    made = _post(client, "/api/keys", {"name": "never", "expires_at": None})
    assert made.status_code == 201, made.content
    assert made.json()["expires_at"] is None
    assert ApiKey.objects.get(pk=made.json()["id"]).expires_at is None


def test_a_past_expiry_is_refused_naming_the_field_and_a_future_one_is_kept(
    client: Client,
) -> None:
    past = (timezone.now() - timedelta(minutes=1)).isoformat()
    resp = _post(client, "/api/keys", {"name": "late", "expires_at": past})
    assert resp.status_code == 400, resp.content
    assert resp.json()["error"]["fields"]["expires_at"] == ["must be in the future"]
    assert not ApiKey.objects.filter(name="late").exists()
    future = timezone.now() + timedelta(days=2)
    resp = _post(client, "/api/keys", {"name": "soon", "expires_at": future.isoformat()})
    assert resp.status_code == 201, resp.content
    assert ApiKey.objects.get(name="soon").expires_at == future


@pytest.mark.parametrize("expires_at", [None, "2999-01-01T00:00:00Z"])
def test_expires_at_and_expires_in_days_together_are_refused(
    client: Client, expires_at: Any
) -> None:
    key = _component(_schema(client), "/api/keys")
    assert key["not"] == {"required": ["expires_at", "expires_in_days"]}
    body = {"name": "both", "expires_at": expires_at, "expires_in_days": 3}
    resp = _post(client, "/api/keys", body)
    assert resp.status_code == 400, resp.content
    assert "not both" in resp.json()["error"]["fields"]["expires_in_days"][0]
    assert not ApiKey.objects.filter(name="both").exists()


def test_a_key_needs_a_scope_as_the_schema_says(client: Client) -> None:
    assert _component(_schema(client), "/api/keys")["properties"]["scopes"]["minItems"] == 1
    resp = _post(client, "/api/keys", {"name": "none", "scopes": []})
    assert resp.status_code == 400 and "scopes" in resp.json()["error"]["fields"]
