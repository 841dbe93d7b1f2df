# Issue 28: per-key and per-account request limits, and a key's parent key.

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0002_apikey_expiry"),
    ]

    operations = [
        migrations.AddField(
            model_name="account",
            name="requests_per_minute",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="account",
            name="tokens_per_minute",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="account",
            name="max_concurrent",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="parent",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="children",
                to="accounts.apikey",
            ),
        ),
        migrations.AddField(
            model_name="apikey",
            name="requests_per_minute",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_minute",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="max_concurrent",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
