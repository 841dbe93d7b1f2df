"""The API keys page (every user) and the accounts page (operators), with the invite flow."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from apps.accounts.models import Account, ApiKey
from apps.jobs.models import Job
from tests.support.ui import HTMX, World

pytestmark = pytest.mark.django_db


def test_a_contributor_creates_a_key_sees_it_once_and_revokes_it(
    contributor_client: Client, world: World
) -> None:
    page = contributor_client.get("/keys/")
    assert page.status_code == 200 and b"API keys" in page.content
    assert b'value="admin"' not in page.content  # contributors are not offered the admin scope
    made = contributor_client.post(
        "/keys/",
        {"name": "my-agent", "scopes": ["inference", "read"], "expires_in_days": "7"},
        **HTMX,
    )
    assert made.status_code == 200
    secret = re.search(rb'id="key-secret" class="command">(rk_[^<]+)<', made.content)
    assert secret is not None and b'hx-swap-oob="true"' in made.content
    key = ApiKey.objects.get(name="my-agent")
    assert key.account.user == world.contributor and key.scopes == ["inference", "read"]
    assert key.expires_at is not None
    assert secret.group(1) not in contributor_client.get("/keys/").content  # shown once
    # Usage of the key shows on the page.
    Job.objects.filter(pk=world.own_job.pk).update(api_key=key)
    table = contributor_client.get("/keys/", **HTMX).content.decode()
    assert 'id="key-table"' in table and "<html" not in table
    row = table[table.index(f'id="key-{key.id}"') :].split("</tr>", 1)[0]
    assert ">25<" in row  # 5 prompt + 20 completion tokens
    gone = contributor_client.post(f"/keys/{key.id}/revoke", **HTMX)
    assert gone.status_code == 200 and f"key-{key.id}" not in gone.content.decode()
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None


def test_a_contributor_cannot_revoke_someone_elses_key_or_see_accounts(
    contributor_client: Client, world: World
) -> None:
    staff_account = Account.objects.get(user=world.staff)
    other = ApiKey.objects.create(
        name="x", prefix="rk_x", key_hash="f" * 64, account=staff_account, scopes=["inference"]
    )
    assert contributor_client.post(f"/keys/{other.id}/revoke").status_code == 404
    assert contributor_client.get("/accounts/").status_code == 403


def test_an_operator_invites_a_contributor_from_the_accounts_page(
    staff_client: Client, world: World
) -> None:
    page = staff_client.get("/accounts/")
    assert page.status_code == 200 and b"user:carl" in page.content
    made = staff_client.post("/accounts/", {"username": "dana", "email": "d@example.org"}, **HTMX)
    assert made.status_code == 200, made.content
    link = re.search(rb'id="invite-url" class="command">[^<]*?(/invite/[^<]+)<', made.content)
    assert link is not None and b"user:dana" in made.content
    path = link.group(1).decode()
    visitor = Client()
    bad = visitor.post(path, {"password": "a long new passphrase", "password2": "different"})
    assert bad.status_code == 422 and b"differ" in bad.content
    ok = visitor.post(
        path, {"password": "a long new passphrase", "password2": "a long new passphrase"}
    )
    assert ok.status_code == 302
    assert visitor.login(username="dana", password="a long new passphrase")
    assert Client().get(path).status_code == 404
    dup = staff_client.post("/accounts/", {"username": "dana"}, **HTMX)
    assert dup.status_code == 422 and b"exists already" in dup.content
