from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.credits.ledger import account_for_user
from apps.credits.models import Receipt
from apps.credits.settlement import credit_reserve, credit_settle_job
from racon import ids
from tests.factories import (
    ModelFactory,
    NodeFactory,
    UserFactory,
    deployment_for,
    job_finish,
    job_for,
)
from tests.support.ui import World


@pytest.fixture(autouse=True)
def _ui_settings(settings: Any, tmp_path: Path) -> None:
    """Each test signs receipts with its own key and keeps models in its own store; fast password hashing."""
    settings.PASSWORD_HASHERS = [
        "django.contrib.auth.hashers.MD5PasswordHasher",
        "django.contrib.auth.hashers.PBKDF2PasswordHasher",
    ]
    settings.RACON_RECEIPT_KEY = ""
    settings.CREDITS_RECEIPT_KEY_PATH = tmp_path / "receipt-signing.key"
    settings.MODEL_STORE_DIR = tmp_path / "store"


@pytest.fixture
def world(db: Any) -> World:
    staff = UserFactory(username="olga", is_staff=True)
    contributor = UserFactory(username="carl")
    staff_acct = account_for_user(user=staff)
    contrib_acct = account_for_user(user=contributor)
    staff_node = NodeFactory(name="ops-box", account=staff_acct)
    own_node = NodeFactory(name="carls-laptop", account=contrib_acct)
    model = ModelFactory(name="tiny-model")
    dep = deployment_for([(staff_node, 20), (own_node, 10)], model=model)
    now = timezone.now()
    jobs = []
    for acct in (staff_acct, contrib_acct):
        job = job_for(account=acct, model=model, deployment=dep, max_tokens=32)
        job.nodes.set([staff_node, own_node])
        credit_reserve(
            account_id=ids.account_id(acct.pk),
            job_id=ids.job_id(job.pk),
            max_tokens=32,
            model_price_permille=1000,
            now=now,
        )
        job_finish(
            job,
            prompt=5,
            completion=20,
            device_seconds={str(staff_node.pk): 1.0, str(own_node.pk): 0.5},
        )
        credit_settle_job(job_id=ids.job_id(job.pk), now=now)
        jobs.append(job)
    return World(
        staff=staff,
        contributor=contributor,
        staff_node=staff_node,
        own_node=own_node,
        deployment=dep,
        staff_job=jobs[0],
        own_job=jobs[1],
        staff_receipt=Receipt.objects.get(job=jobs[0], node=staff_node),
        own_receipt=Receipt.objects.get(job=jobs[1], node=own_node),
    )


@pytest.fixture
def staff_client(world: World) -> Client:
    c = Client()
    c.force_login(world.staff)
    return c


@pytest.fixture
def contributor_client(world: World) -> Client:
    c = Client()
    c.force_login(world.contributor)
    return c


@pytest.fixture(scope="session")
def live(
    django_db_setup: None,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Any:
    """The live controller the browser drives (shared with the CLI and TUI tests of the session)."""
    from tests.cli.live import shared_controller

    return shared_controller(request, django_db_blocker, tmp_path_factory)


@pytest.fixture(scope="session")
def model_path() -> Path:
    from tests.e2e.harness import smollm2_path

    return smollm2_path()
