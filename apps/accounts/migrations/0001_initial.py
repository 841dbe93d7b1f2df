"""Account (was credits.Account) and ApiKey (was api.ApiKey) move here, every row kept.

State only: both tables keep their names (``credits_account``, ``api_apikey``, set by
``Meta.db_table``), so nothing in the database changes. The apps that point at them switch their
foreign keys in their own state-only migrations (credits 0004, jobs 0003, nodes 0002), and the old
apps then drop the models from their state (credits 0004, api 0002). Content types and the
permissions that hang off them are renamed to this app, so admin rights and log entries stay.
"""

from __future__ import annotations

import uuid

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

MOVES = (("credits", "account"), ("api", "apikey"))


def content_types_move(apps, schema_editor, *, forward: bool = True):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    for old_app, model in MOVES:
        src, dst = (old_app, "accounts") if forward else ("accounts", old_app)
        if ContentType.objects.using(db).filter(app_label=dst, model=model).exists():
            continue  # already there (created by a post_migrate of this app's state)
        ContentType.objects.using(db).filter(app_label=src, model=model).update(app_label=dst)


def content_types_back(apps, schema_editor):
    content_types_move(apps, schema_editor, forward=False)


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("contenttypes", "0002_remove_content_type_name"),
        ("credits", "0003_system_accounts"),
        ("api", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="Account",
                    fields=[
                        (
                            "id",
                            models.UUIDField(
                                default=uuid.uuid4,
                                editable=False,
                                primary_key=True,
                                serialize=False,
                            ),
                        ),
                        ("name", models.CharField(max_length=120, unique=True)),
                        (
                            "kind",
                            models.CharField(
                                choices=[("USER", "User"), ("ORG", "Org"), ("SYSTEM", "System")],
                                default="USER",
                                max_length=10,
                            ),
                        ),
                        ("balance", models.BigIntegerField(default=0)),
                        ("floor", models.BigIntegerField(blank=True, default=0, null=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "user",
                            models.OneToOneField(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="credit_account",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={"db_table": "credits_account", "ordering": ["name"]},
                ),
                migrations.CreateModel(
                    name="ApiKey",
                    fields=[
                        (
                            "id",
                            models.UUIDField(
                                default=uuid.uuid4,
                                editable=False,
                                primary_key=True,
                                serialize=False,
                            ),
                        ),
                        ("name", models.CharField(max_length=120)),
                        ("prefix", models.CharField(db_index=True, max_length=16)),
                        ("key_hash", models.CharField(max_length=64, unique=True)),
                        (
                            "scopes",
                            models.JSONField(
                                default=list, help_text='subset of ["inference", "admin"]'
                            ),
                        ),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("revoked_at", models.DateTimeField(blank=True, null=True)),
                        ("last_used_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "account",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="api_keys",
                                to="accounts.account",
                            ),
                        ),
                        (
                            "user",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.CASCADE,
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={"db_table": "api_apikey", "ordering": ["-created_at"]},
                ),
            ],
        ),
        migrations.RunPython(content_types_move, content_types_back),
    ]
