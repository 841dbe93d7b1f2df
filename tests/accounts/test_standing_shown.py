"""An account that lends sees its standing, and how far ahead its waiting requests go, on the
pages where a user looks (issue 28 item 4): the dashboard, the credits page and the keys page
show the figure admission orders by (the same as /api/credits/balance), not only zero."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts import services
from apps.credits.ledger import account_for_user
from apps.credits.settlement import credit_reserve, credit_settle_job
from racon import ids
from tests.factories import (
    NodeFactory,
    UserFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)

pytestmark = pytest.mark.django_db


def lend(account: Any) -> None:
    """The account's machine serves a job and settlement pays it."""
    node = NodeFactory(account=account)
    dep = deployment_for([(node, 4)])
    consumer = funded_account(10**7)
    job = job_for(account=consumer, model=dep.model, deployment=dep, max_tokens=50)
    now = timezone.now()
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=50,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=50)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)


def test_a_lenders_standing_and_priority_show_on_its_pages_as_admission_counts_them(
    client: Client,
) -> None:
    user = UserFactory()
    account = account_for_user(user=user)
    lend(account)
    client.force_login(user)
    _, key = services.key_create(
        name="k", account_id=ids.account_id(account.pk), scopes=["read"], user_id=user.pk
    )
    balance = client.get("/api/credits/balance", HTTP_AUTHORIZATION=f"Bearer {key}").json()
    assert balance["standing"] > 0 and balance["priority_seconds"] > 0, balance
    ahead = f"go {balance['priority_seconds']} s ahead"
    for page in ("/keys/", "/credits/"):
        text = client.get(page).content.decode()
        assert ahead in text, (page, re.findall(r"go [0-9.]+ s ahead", text))
    dashboard = client.get("/").content.decode()
    assert 'id="standing"' in dashboard and "Standing in the queue" in dashboard
