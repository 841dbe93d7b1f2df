"""A contributor's own key through the official openai SDK against a live daphne: the usage is
charged to the contributor's account and shown per key, and a key revoked in another process is
refused (401) by daphne within moments although its principal cache holds entries for 300 s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from apps.accounts.models import Account, ApiKey
from apps.api.auth import api_key_revoke
from apps.jobs.models import Deployment, Job
from apps.jobs.states import JobState
from tests.api import live
from tests.factories import live_deployment

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
OPERATOR = {"Authorization": "Bearer test-operator-key"}


@pytest.fixture
def daphne(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[live.Daphne]:
    monkeypatch.setattr(live, "PORTS", range(19300, 19400))
    with live.run_daphne(tmp_path, API_CACHE_SECONDS="300", JOB_QUEUE_WAIT_SECONDS="60") as d:
        yield d


@pytest.fixture
def dep() -> Deployment:
    return live_deployment()


def test_a_contributors_key_is_charged_to_their_account_and_refused_once_revoked(
    daphne: live.Daphne, dep: Deployment
) -> None:
    http = httpx.Client(base_url=daphne.url, timeout=30)
    made = http.post(
        "/api/admin/accounts",
        json={"username": "carol", "password": "a long enough passphrase"},
        headers=OPERATOR,
    )
    assert made.status_code == 201, made.text
    account_id = made.json()["id"]
    start = made.json()["balance"]
    # The operator hands the contributor a key that manages keys; the contributor makes an app key.
    manager = http.post(
        "/api/keys",
        json={"name": "carol-cli", "scopes": ["keys", "read", "inference"], "account": account_id},
        headers=OPERATOR,
    ).json()["key"]
    mine = {"Authorization": f"Bearer {manager}"}
    app_key = http.post("/api/keys", json={"name": "my-app", "scopes": ["inference"]}, headers=mine)
    assert app_key.status_code == 201, app_key.text
    secret, key_id = app_key.json()["key"], app_key.json()["id"]

    client = openai.OpenAI(base_url=daphne.url + "/v1", api_key=secret, max_retries=0)
    with live.FakePrimary(node_id=str(dep.primary_id)):
        answer = client.chat.completions.create(
            model="live-model", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
    assert answer.choices[0].message.content == "Hello there."
    job = Job.objects.get(api_key_id=key_id)
    assert str(job.account_id) == account_id and job.state == JobState.COMPLETED

    deadline = time.monotonic() + 30
    while True:
        usage = {u["name"]: u for u in http.get("/api/credits/usage", headers=mine).json()}
        if usage["my-app"]["credits"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert usage["my-app"]["jobs"] == 1 and usage["my-app"]["total_tokens"] == 15, usage
    assert usage["my-app"]["credits"] > 0 and usage["carol-cli"]["jobs"] == 0
    assert Account.objects.get(pk=account_id).balance == start - usage["my-app"]["credits"]
    keys = {k["name"]: k for k in http.get("/api/keys", headers=mine).json()}
    assert keys["my-app"]["last_used_at"] is not None

    api_key_revoke(key_id=key_id)  # in this process: daphne hears of it over pub/sub
    assert ApiKey.objects.get(pk=key_id).revoked_at is not None
    deadline = time.monotonic() + 5
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError as exc:
            assert exc.status_code == 401 and exc.body["code"] == "invalid_api_key"
            break
        assert time.monotonic() < deadline, "daphne still accepts the revoked key"
        time.sleep(0.1)
