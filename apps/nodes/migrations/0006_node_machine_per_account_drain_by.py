"""Issue 28: machine_id is unique within an account only (it comes from the world-readable
/etc/machine-id), and a drain records who asked for it (the agent's resume lifts only its own)."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("nodes", "0005_node_lending"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="drain_requested_by",
            field=models.CharField(blank=True, default="", max_length=16),
        ),
        migrations.AlterField(
            model_name="node",
            name="machine_id",
            field=models.CharField(max_length=128),
        ),
        migrations.AddConstraint(
            model_name="node",
            constraint=models.UniqueConstraint(
                fields=("account", "machine_id"),
                name="node_machine_unique_per_account",
                violation_error_message="a machine is enrolled once within an account",
            ),
        ),
    ]
