"""Self-service accounts and API keys through REST: invites, scopes, expiry, revocation, usage."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts import services
from apps.accounts.models import Account, ApiKey
from apps.api.auth import principal_for_key
from apps.credits.ledger import account_for_user, credit_grant
from apps.credits.settlement import credit_reserve, credit_settle_job
from apps.jobs.models import Job
from racon import cache, ids
from racon.redis import get_redis
from tests.factories import (
    ModelFactory,
    NodeFactory,
    UserFactory,
    deployment_for,
    job_finish,
    job_for,
)

pytestmark = pytest.mark.django_db
OPERATOR: dict[str, Any] = {"HTTP_AUTHORIZATION": "Bearer test-operator-key"}


def bearer(key: str) -> dict[str, Any]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def key_of(user: Any, *scopes: str, **kw: Any) -> str:
    return services.key_create(
        name="k",
        account_id=ids.account_id(account_for_user(user=user).id),
        scopes=list(scopes),
        user_id=user.pk,
        **kw,
    )[1]


def test_an_operator_invites_a_contributor_who_sets_a_password_once(
    client: Client, settings: Any
) -> None:
    settings.CREDITS_STARTING_GRANT = 5_000
    resp = client.post(
        "/api/admin/accounts",
        {"username": "ada", "email": "ada@example.org"},
        content_type="application/json",
        **OPERATOR,
    )
    assert resp.status_code == 201, resp.content
    body = resp.json()
    assert body["name"] == "user:ada" and body["balance"] == 5_000 and body["invite_pending"]
    path = body["invite_url"].split("://", 1)[1].split("/", 1)[1]
    assert path.startswith("invite/")
    # Not signed in yet: the user has no usable password.
    assert not Client().login(username="ada", password="a long new passphrase")
    page = Client().get("/" + path)
    assert page.status_code == 200 and b"ada" in page.content
    done = Client().post(
        "/" + path, {"password": "a long new passphrase", "password2": "a long new passphrase"}
    )
    assert done.status_code == 302
    assert Client().login(username="ada", password="a long new passphrase")
    assert Client().get("/" + path).status_code == 404  # the link worked once
    listed = client.get("/api/admin/accounts", **OPERATOR).json()
    ada = next(a for a in listed if a["username"] == "ada")
    assert ada["invite_pending"] is False and ada["balance"] == 5_000


def test_an_operator_creates_an_account_with_a_password_and_a_contributor_may_not(
    client: Client,
) -> None:
    resp = client.post(
        "/api/admin/accounts",
        {"username": "bob", "password": "correct horse battery staple"},
        content_type="application/json",
        **OPERATOR,
    )
    assert resp.status_code == 201 and resp.json()["invite_url"] is None
    assert Client().login(username="bob", password="correct horse battery staple")
    dup = client.post(
        "/api/admin/accounts", {"username": "bob"}, content_type="application/json", **OPERATOR
    )
    error = dup.json()["error"]
    assert dup.status_code == 409 and error["code"] == "username_taken"
    assert "exists already" in error["fields"]["username"][0]
    contributor = Client()
    contributor.force_login(UserFactory())
    assert contributor.get("/api/admin/accounts").status_code == 403
    assert (
        contributor.post(
            "/api/admin/accounts", {"username": "eve"}, content_type="application/json"
        ).status_code
        == 403
    )


def test_a_contributor_creates_lists_and_revokes_their_own_key(client: Client) -> None:
    user = UserFactory()
    client.force_login(user)
    resp = client.post(
        "/api/keys",
        {"name": "my-agent", "scopes": ["inference", "read"], "expires_in_days": 30},
        content_type="application/json",
    )
    assert resp.status_code == 201, resp.content
    made = resp.json()
    secret = made["key"]
    assert secret.startswith(made["prefix"]) and made["status"] == "active"
    stored = ApiKey.objects.get(pk=made["id"])
    assert stored.key_hash == services.key_hash(secret) and secret not in str(stored.__dict__)
    assert stored.account_id == account_for_user(user=user).id and stored.user_id == user.pk
    listed = client.get("/api/keys").json()
    assert [k["id"] for k in listed] == [made["id"]] and "key" not in listed[0]
    # The key itself (read scope) sees the same list.
    assert [k["id"] for k in client.get("/api/keys", **bearer(secret)).json()] == [made["id"]]
    assert client.get("/v1/models", **bearer(secret)).status_code == 200
    revoked = client.post(f"/api/keys/{made['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    err = client.get("/v1/models", **bearer(secret))
    assert err.status_code == 401
    assert err.json() == {
        "error": {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert Client().get("/api/keys", **bearer(secret)).status_code == 401
    assert client.get("/api/keys").json() == []
    assert [k["status"] for k in client.get("/api/keys?all=true").json()] == ["revoked"]


def test_a_user_cannot_see_or_revoke_another_users_key(client: Client) -> None:
    theirs = ApiKey.objects.get(key_hash=services.key_hash(key_of(UserFactory(), "inference")))
    client.force_login(UserFactory())
    assert client.post(f"/api/keys/{theirs.pk}/revoke").status_code == 404
    assert client.get(f"/api/keys?account={theirs.account_id}").status_code == 403
    assert ApiKey.objects.get(pk=theirs.pk).revoked_at is None


def test_scopes_are_enforced(client: Client) -> None:
    user = UserFactory()
    inference = key_of(user, "inference")
    assert client.get("/v1/models", **bearer(inference)).status_code == 200
    for path in ("/api/keys", "/api/credits/usage", "/api/admin/accounts", "/api/admin/nodes"):
        assert client.get(path, **bearer(inference)).status_code == 403, path
    assert (
        client.post(
            "/api/keys", {"name": "x"}, content_type="application/json", **bearer(inference)
        ).status_code
        == 403
    )
    read = key_of(user, "read")
    assert client.get("/api/keys", **bearer(read)).status_code == 200
    err = client.get("/v1/models", **bearer(read))
    assert err.status_code == 403 and err.json()["error"]["code"] == "insufficient_scope"
    assert (
        client.post(
            "/api/keys", {"name": "x"}, content_type="application/json", **bearer(read)
        ).status_code
        == 403
    )
    manager = key_of(user, "keys", "inference")
    made = client.post(
        "/api/keys",
        {"name": "child", "scopes": ["inference"]},
        content_type="application/json",
        **bearer(manager),
    )
    assert made.status_code == 201 and made.json()["scopes"] == ["inference"]
    # No escalation: not a scope the key lacks, and never admin for a contributor.
    for scopes in (["read"], ["admin"]):
        resp = client.post(
            "/api/keys",
            {"name": "more", "scopes": scopes},
            content_type="application/json",
            **bearer(manager),
        )
        assert resp.status_code == 403, scopes
    with pytest.raises(ValueError, match="operator"):
        key_of(user, "admin")


def test_a_staff_users_inference_key_is_not_an_admin_key(client: Client) -> None:
    staff = UserFactory(is_staff=True)
    assert client.get("/api/admin/nodes", **bearer(key_of(staff, "inference"))).status_code == 403
    assert client.get("/api/admin/nodes", **bearer(key_of(staff, "admin"))).status_code == 200


def test_an_expired_key_gets_401_in_openais_format_even_while_cached(
    client: Client, settings: Any
) -> None:
    settings.API_CACHE_SECONDS = 300
    user = UserFactory()
    now = timezone.now()
    secret = key_of(user, "inference", expires_at=now + timedelta(hours=1), now=now)
    assert principal_for_key(secret, now=now) is not None  # cached from here on
    assert principal_for_key(secret, now=now + timedelta(hours=2)) is None
    ApiKey.objects.update(expires_at=now - timedelta(seconds=1))
    cache.invalidate("principal")
    err = client.get("/v1/models", **bearer(secret))
    assert err.status_code == 401 and err.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/api/keys").status_code in (401, 403)
    listed = services.key_create(
        name="later", account_id=ids.account_id(account_for_user(user=user).id), scopes=["read"]
    )[1]
    statuses = {k["name"]: k["status"] for k in client.get("/api/keys", **bearer(listed)).json()}
    assert statuses == {"k": "expired", "later": "active"}
    with pytest.raises(ValueError, match="future"):
        key_of(user, "inference", expires_at=now - timedelta(days=1), now=now)


def test_last_used_is_written_at_most_once_a_minute_per_key(django_assert_num_queries: Any) -> None:
    user = UserFactory()
    secret = key_of(user, "inference")
    key = ApiKey.objects.get(key_hash=services.key_hash(secret))
    services.key_touch_forget()
    get_redis().delete(f"racon:apikey:{key.pk}:touched")
    t0 = timezone.now()
    assert services.key_touch(key_id=ids.api_key_id(key.pk), now=t0) is True
    with django_assert_num_queries(0):
        for s in range(1, 59):
            assert (
                services.key_touch(key_id=ids.api_key_id(key.pk), now=t0 + timedelta(seconds=s))
                is False
            )
    # Another process (its own memory, the shared Redis throttle) does not write either.
    services.key_touch_forget()
    with django_assert_num_queries(0):
        assert (
            services.key_touch(key_id=ids.api_key_id(key.pk), now=t0 + timedelta(seconds=30))
            is False
        )
    assert ApiKey.objects.get(pk=key.pk).last_used_at == t0
    get_redis().delete(f"racon:apikey:{key.pk}:touched")  # the minute is up
    later = t0 + timedelta(seconds=91)
    assert services.key_touch(key_id=ids.api_key_id(key.pk), now=later) is True
    assert ApiKey.objects.get(pk=key.pk).last_used_at == later


def test_a_used_key_shows_when_it_was_last_used(client: Client) -> None:
    user = UserFactory()
    secret = key_of(user, "inference", "read")
    key = ApiKey.objects.get(key_hash=services.key_hash(secret))
    services.key_touch_forget()
    get_redis().delete(f"racon:apikey:{key.pk}:touched")
    assert client.get("/v1/models", **bearer(secret)).status_code == 200
    (listed,) = client.get("/api/keys", **bearer(secret)).json()
    assert listed["last_used_at"] is not None


def test_usage_per_key_counts_tokens_and_the_credits_charged_to_the_keys_account(
    client: Client,
) -> None:
    now = timezone.now()
    user = UserFactory()
    account = account_for_user(user=user)
    credit_grant(account_id=ids.account_id(account.id), amount=1_000_000, reason="test", now=now)
    start = Account.objects.get(pk=account.pk).balance
    a = services.key_create(
        name="a", account_id=ids.account_id(account.id), scopes=["inference", "read"]
    )
    b = services.key_create(name="b", account_id=ids.account_id(account.id), scopes=["inference"])
    node = NodeFactory(account=Account.objects.create(name="owner"))
    model = ModelFactory()
    dep = deployment_for([(node, 10)], model=model)
    for key, completion in ((a[0], 30), (a[0], 20), (b[0], 5)):
        job = job_for(account=account, model=model, deployment=dep, max_tokens=100)
        Job.objects.filter(pk=job.pk).update(api_key=key)
        credit_reserve(
            account_id=ids.account_id(account.id),
            job_id=ids.job_id(job.pk),
            max_tokens=100,
            model_price_permille=1000,
            now=now,
        )
        job_finish(job, prompt=4, completion=completion)
        credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    usage = {u["name"]: u for u in client.get("/api/credits/usage", **bearer(a[1])).json()}
    assert (usage["a"]["jobs"], usage["a"]["prompt_tokens"], usage["a"]["completion_tokens"]) == (
        2,
        8,
        50,
    )
    assert usage["b"]["total_tokens"] == 9
    charged = usage["a"]["credits"] + usage["b"]["credits"]
    assert usage["a"]["credits"] > usage["b"]["credits"] > 0
    assert Account.objects.get(pk=account.pk).balance == start - charged
