from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from apps.accounts.models import Account
from apps.credits.settlement import credit_reserve, credit_settle_job
from apps.jobs.models import Deployment
from apps.models_repo.models import Model
from racon import ids
from tests.factories import (
    AccountFactory,
    ModelFactory,
    NodeFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)


@pytest.fixture(autouse=True)
def _receipt_key(settings: Any, tmp_path: Path) -> None:
    """Each test signs with its own key file, never the developer's var/ key."""
    settings.RACON_RECEIPT_KEY = ""
    settings.CREDITS_RECEIPT_KEY_PATH = tmp_path / "receipt-signing.key"


@pytest.fixture
def price(settings: Any) -> Any:
    """Round, easy prices: 1000 µ per token at weight 1000, 10% primary bonus, no fee, no escrow."""
    settings.CREDITS_MICRO_PER_TOKEN = 1_000
    settings.CREDITS_PRIMARY_SHARE_PERMILLE = 100
    settings.CREDITS_FEE_PERMILLE = 0
    settings.CREDITS_ESCROW_ENABLED = False
    return settings


def settle_at(
    *, dep: Deployment, model: Model, consumer: Account, at: Any, completion: int = 60
) -> None:
    job = job_for(account=consumer, model=model, deployment=dep, max_tokens=100)
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=100,
        model_price_permille=1000,
        now=at,
    )
    job_finish(job, completion=completion)
    credit_settle_job(job_id=ids.job_id(job.pk), now=at)


@pytest.fixture
def earned(price: Any, now: Any) -> dict[str, Any]:
    """An owner with two nodes (a and b) sharing a deployment with a stranger's node; jobs
    settled today (two), three days ago (one) and forty days ago (one)."""
    owner, stranger = AccountFactory(), AccountFactory()
    a, b = NodeFactory(name="own-a", account=owner), NodeFactory(name="own-b", account=owner)
    other = NodeFactory(name="strangers", account=stranger)
    model = ModelFactory()
    dep = deployment_for([(a, 10), (b, 10), (other, 10)], model=model)
    consumer = funded_account(10_000_000)
    for at in (now, now, now - timedelta(days=3), now - timedelta(days=40)):
        settle_at(dep=dep, model=model, consumer=consumer, at=at)
    return {"owner": owner, "stranger": stranger, "a": a, "b": b, "other": other, "now": now}
