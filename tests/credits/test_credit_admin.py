from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.accounts.models import Account
from apps.credits.models import Entry, Posting, Receipt
from apps.credits.settlement import credit_reserve, credit_settle_job
from racon import ids
from tests.factories import (
    ModelFactory,
    NodeFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_with_ledger(client: Client, price: Any, now: Any) -> Client:
    node = NodeFactory()
    model = ModelFactory()
    consumer = funded_account(100_000)
    job = job_for(
        account=consumer,
        model=model,
        deployment=deployment_for([(node, 4)], model=model),
        max_tokens=10,
    )
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=10,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=5)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw-test-123")
    client.force_login(user)
    return client


def test_the_ledger_is_browsable_in_the_django_admin(admin_client_with_ledger: Client) -> None:
    c = admin_client_with_ledger
    for path in ("accounts/account", "credits/entry", "credits/posting", "credits/receipt"):
        assert c.get(f"/django-admin/{path}/").status_code == 200, path
    entry = Entry.objects.filter(kind="SETTLE").get()
    assert c.get(f"/django-admin/credits/entry/{entry.pk}/change/").status_code == 200
    receipt = Receipt.objects.get()
    assert c.get(f"/django-admin/credits/receipt/{receipt.pk}/change/").status_code == 200


def test_postings_entries_and_receipts_cannot_be_added_changed_or_deleted_in_the_admin(
    admin_client_with_ledger: Client,
) -> None:
    c = admin_client_with_ledger
    posting = Posting.objects.first()
    assert posting is not None
    assert c.get("/django-admin/credits/posting/add/").status_code == 403
    assert c.get(f"/django-admin/credits/posting/{posting.pk}/delete/").status_code == 403
    before = posting.amount
    c.post(f"/django-admin/credits/posting/{posting.pk}/change/", {"amount": 1})
    assert Posting.objects.get(pk=posting.pk).amount == before
    assert c.get("/django-admin/credits/entry/add/").status_code == 403
    assert c.get("/django-admin/credits/receipt/add/").status_code == 403


def test_an_account_added_in_the_admin_gets_the_starting_grant(
    admin_client_with_ledger: Client, settings: Any
) -> None:
    settings.CREDITS_STARTING_GRANT = 4_242
    resp = admin_client_with_ledger.post(
        "/django-admin/accounts/account/add/", {"name": "org:lab", "kind": "ORG", "floor": "0"}
    )
    assert resp.status_code == 302, resp.content
    assert Account.objects.get(name="org:lab").balance == 4_242
