"""Job.priority was never read or written: admission keeps a waiting request's priority in Redis."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_account_moves_to_accounts"),
    ]

    operations = [
        migrations.RemoveField(model_name="job", name="priority"),
    ]
