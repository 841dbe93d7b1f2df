"""Drained becomes a state: DRAINING nodes whose drain had finished (drained_at set) are DRAINED."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def drained_flag_to_state(apps: Any, schema_editor: Any) -> None:
    Node = apps.get_model("nodes", "Node")
    Node.objects.filter(state="DRAINING", drained_at__isnull=False).update(state="DRAINED")


def drained_state_to_flag(apps: Any, schema_editor: Any) -> None:
    Node = apps.get_model("nodes", "Node")
    for node in Node.objects.filter(state="DRAINED"):
        Node.objects.filter(pk=node.pk).update(state="DRAINING", drained_at=node.state_changed_at)


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0003_node_speed_challenge_unique_name"),
    ]

    operations = [
        migrations.AlterField(
            model_name="node",
            name="state",
            field=models.CharField(
                choices=[
                    ("UNINITIALIZED", "Uninitialized"),
                    ("REGISTERING", "Registering"),
                    ("READY", "Ready"),
                    ("BUSY", "Busy"),
                    ("DRAINING", "Draining"),
                    ("DRAINED", "Drained"),
                    ("DEGRADED", "Degraded"),
                    ("OFFLINE", "Offline"),
                    ("ERROR", "Error"),
                ],
                default="UNINITIALIZED",
                max_length=16,
            ),
        ),
        migrations.RunPython(drained_flag_to_state, drained_state_to_flag),
        migrations.RemoveField(
            model_name="node",
            name="drained_at",
        ),
    ]
