"""ApiKey leaves this app's state for accounts.ApiKey (its table, api_apikey, stays)."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("api", "0001_initial"),
        ("jobs", "0003_account_moves_to_accounts"),  # Job.api_key has moved first
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[migrations.DeleteModel(name="ApiKey")],
        ),
    ]
