# Issue 30: a deployment's engine (llamacpp, the default, or vllm).

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_minute_rollup"),
    ]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="engine",
            field=models.CharField(
                choices=[("llamacpp", "llama.cpp"), ("vllm", "vLLM")],
                default="llamacpp",
                max_length=16,
            ),
        ),
    ]
