"""`racon accounts ...` and `racon keys ...` against a live controller."""

from __future__ import annotations

import json

import pytest

from apps.accounts.models import ApiKey
from racon_cli.client import EXIT_API
from tests.support.cli import Run, one_error_line

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_an_operator_creates_and_invites_accounts_and_lists_them(racon: Run) -> None:
    res = racon("accounts", "create", "erin", "--password", "a long enough passphrase")
    assert res.exit_code == 0, res.output
    assert "user:erin" in res.stdout and "invite" not in res.stdout
    res = racon("accounts", "invite", "fay", "--email", "fay@example.org")
    assert res.exit_code == 0, res.output
    assert "/invite/" in res.stdout.splitlines()[-1]
    again = racon("accounts", "invite", "fay").stdout.splitlines()[-1]
    assert "/invite/" in again
    listed = json.loads(racon("accounts", "list", "--json").stdout)
    by_user = {a["username"]: a for a in listed}
    assert by_user["fay"]["invite_pending"] and not by_user["erin"]["invite_pending"]
    table = racon("accounts", "ls").stdout
    assert "invited" in table and "user:erin" in table
    res = racon("accounts", "invite", "erin")  # has a password: no invite that would reset it
    assert res.exit_code == EXIT_API and "password already" in one_error_line(res)


def test_a_contributor_manages_their_keys_with_the_cli(racon: Run) -> None:
    erin = json.loads(
        racon(
            "accounts", "create", "gus", "--password", "a long enough passphrase", "--json"
        ).stdout
    )
    made = json.loads(
        racon(
            "keys",
            "create",
            "gus-cli",
            "--scope",
            "keys",
            "--scope",
            "read",
            "--scope",
            "inference",
            "--account",
            erin["id"],
            "--json",
        ).stdout
    )
    own = made["key"]
    res = racon("keys", "create", "my-app", "--expires-in-days", "30", key=own)
    assert res.exit_code == 0, res.output
    app_secret = res.stdout.splitlines()[-1]
    assert app_secret.startswith("rk_")
    listed = json.loads(racon("keys", "list", "--json", key=own).stdout)
    assert {k["name"] for k in listed} == {"gus-cli", "my-app"}
    assert all(k["usage"]["jobs"] == 0 for k in listed)
    table = racon("keys", "ls", key=own).stdout
    assert "my-app" in table and "inference" in table
    assert "my-app" in racon("keys", "usage", key=own).stdout
    res = racon("keys", "revoke", app_secret[:8], key=own)
    assert res.exit_code == 0 and "Revoked key 'my-app'" in res.stdout
    assert ApiKey.objects.get(name="my-app").revoked_at is not None
    res = racon("keys", "ls", key=app_secret)
    assert res.exit_code == EXIT_API and "401" in one_error_line(res)
    res = racon("keys", "create", "admin-key", "--scope", "admin", key=own)
    assert res.exit_code == EXIT_API and "403" in one_error_line(res)
    res = racon("accounts", "ls", key=own)
    assert res.exit_code == EXIT_API and "403" in one_error_line(res)


def test_an_operator_sets_a_keys_and_an_accounts_limits_with_the_cli(racon: Run) -> None:
    acct = json.loads(
        racon(
            "accounts", "create", "hal", "--password", "a long enough passphrase", "--json"
        ).stdout
    )
    made = json.loads(
        racon("keys", "create", "hal-agent", "--account", acct["id"], "--json").stdout
    )
    res = racon("keys", "limits", made["id"], "--rpm", "60", "--concurrent", "2")
    assert res.exit_code == 0, res.output
    assert "requests/min 60," in res.stdout and "at once 2" in res.stdout
    assert "tokens/min 1000000 (default)" in res.stdout
    key = ApiKey.objects.get(pk=made["id"])
    assert (key.requests_per_minute, key.max_concurrent) == (60, 2)
    got = json.loads(racon("keys", "limits", made["id"], "--json").stdout)
    assert got["effective"]["max_concurrent"] == 2 and got["tokens_per_minute"] is None
    res = racon("keys", "limits", acct["id"], "--account", "--concurrent", "0")
    assert res.exit_code == 0 and "at once no limit" in res.stdout, res.output
    res = racon("keys", "limits", made["id"], "--default")
    assert "requests/min 300 (default)" in res.stdout, res.output
