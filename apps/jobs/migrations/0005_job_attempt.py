"""JobAttempt: one run of a job on one deployment (failover, docs/design/serving.md)."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0004_remove_job_priority"),
        ("nodes", "0004_node_drained_state"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobAttempt",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("number", models.PositiveIntegerField()),
                (
                    "plan",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="the deployment's plan when the attempt ran (settlement)",
                    ),
                ),
                ("started_at", models.DateTimeField()),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                (
                    "completion_tokens",
                    models.PositiveIntegerField(
                        default=0, help_text="counted by the controller from this attempt's stream"
                    ),
                ),
                ("chunks", models.PositiveIntegerField(default=0)),
                (
                    "outcome",
                    models.CharField(
                        blank=True,
                        help_text="empty while running; COMPLETED, FAILED, CANCELLED or the failover cause",
                        max_length=32,
                    ),
                ),
                ("error", models.TextField(blank=True)),
                (
                    "deployment",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="job_attempts",
                        to="jobs.deployment",
                    ),
                ),
                (
                    "job",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="attempts",
                        to="jobs.job",
                    ),
                ),
                (
                    "primary",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="job_attempts",
                        to="nodes.node",
                    ),
                ),
            ],
            options={
                "ordering": ["job", "number"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("job", "number"), name="job_attempt_unique_number"
                    )
                ],
            },
        ),
    ]
