"""EnrollmentToken.account and Node.account point at accounts.Account (state only: same table)."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("nodes", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField(
                    model_name="enrollmenttoken",
                    name="account",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="enrollment_tokens",
                        to="accounts.account",
                    ),
                ),
                migrations.AlterField(
                    model_name="node",
                    name="account",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="nodes",
                        to="accounts.account",
                    ),
                ),
            ],
        ),
    ]
