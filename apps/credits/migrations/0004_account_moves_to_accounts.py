"""The ledger points at accounts.Account; Account leaves this app's state (its table stays)."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("credits", "0003_system_accounts"),
        # Every other foreign key to the account has moved before the model leaves this state.
        ("jobs", "0003_account_moves_to_accounts"),
        ("nodes", "0002_account_moves_to_accounts"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField(
                    model_name="posting",
                    name="account",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="postings",
                        to="accounts.account",
                    ),
                ),
                migrations.AlterField(
                    model_name="posting",
                    name="beneficiary",
                    field=models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="beneficiary_postings",
                        to="accounts.account",
                    ),
                ),
                migrations.AlterField(
                    model_name="receipt",
                    name="account",
                    field=models.ForeignKey(
                        help_text="the node's owner",
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="receipts",
                        to="accounts.account",
                    ),
                ),
                migrations.DeleteModel(name="Account"),
            ],
        ),
    ]
