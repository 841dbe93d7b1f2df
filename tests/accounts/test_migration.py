"""Moving Account and ApiKey into apps.accounts keeps every row (a state-only migration)."""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from apps.accounts.models import Account, ApiKey

# Before the move: the old apps' last migrations, where credits.Account and api.ApiKey live.
BEFORE_STATE = [("credits", "0003_system_accounts"), ("api", "0001_initial")]


@pytest.mark.django_db(transaction=True)
def test_account_move_keeps_rows() -> None:
    executor = MigrationExecutor(connection)
    # Unapply the move and everything that depends on it (the other apps' state-only steps).
    executor.migrate([("accounts", None)])
    try:
        executor.loader.build_graph()
        old = executor.loader.project_state(BEFORE_STATE).apps
        OldAccount = old.get_model("credits", "Account")
        OldApiKey = old.get_model("api", "ApiKey")
        acct = OldAccount.objects.create(
            name="user:before-the-move", kind="USER", balance=1234, floor=0
        )
        key = OldApiKey.objects.create(
            name="old key", prefix="rk_old12", key_hash="a" * 64, account=acct, scopes=["inference"]
        )
        assert ContentType.objects.filter(app_label="credits", model="account").exists()
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())

    moved = Account.objects.get(pk=acct.pk)
    assert (moved.name, moved.kind, moved.balance, moved.floor) == (
        "user:before-the-move",
        "USER",
        1234,
        0,
    )
    moved_key = ApiKey.objects.get(pk=key.pk)
    assert (moved_key.name, moved_key.prefix, moved_key.key_hash) == (
        "old key",
        "rk_old12",
        "a" * 64,
    )
    assert moved_key.account_id == acct.pk and moved_key.scopes == ["inference"]
    assert list(moved.api_keys.values_list("pk", flat=True)) == [key.pk]
    # The tables kept their names, and the content types (and their permissions) moved along.
    assert Account._meta.db_table == "credits_account" and ApiKey._meta.db_table == "api_apikey"
    assert ContentType.objects.filter(app_label="accounts", model="account").exists()
    assert not ContentType.objects.filter(app_label="credits", model="account").exists()
