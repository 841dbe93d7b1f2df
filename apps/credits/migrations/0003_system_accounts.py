"""Create the system accounts up front so the first requests never race to create them."""

from __future__ import annotations

import uuid

from django.db import migrations

SYSTEM_ACCOUNTS = {
    "system:mint": None,
    "system:fees": None,
    "system:escrow": 0,
    "system:holds": 0,
    "system:operator": None,
}


def create(apps, schema_editor):
    Account = apps.get_model("credits", "Account")
    for name, floor in SYSTEM_ACCOUNTS.items():
        if not Account.objects.filter(name=name).exists():
            Account.objects.create(id=uuid.uuid4(), name=name, kind="SYSTEM", floor=floor)
        elif name in ("system:escrow", "system:holds"):
            Account.objects.filter(name=name).update(floor=0)


class Migration(migrations.Migration):
    dependencies = [("credits", "0002_ledger")]

    operations = [migrations.RunPython(create, migrations.RunPython.noop)]
