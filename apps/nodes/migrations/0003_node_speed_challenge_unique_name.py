from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0002_account_moves_to_accounts"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="gflops_claimed",
            field=models.FloatField(default=0),
        ),
        migrations.AddField(
            model_name="node",
            name="speed_verified_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="node",
            constraint=models.UniqueConstraint(
                condition=models.Q(("revoked_at__isnull", True)),
                fields=("account", "name"),
                name="node_name_unique_per_account",
                violation_error_message="node names are unique within an account",
            ),
        ),
    ]
