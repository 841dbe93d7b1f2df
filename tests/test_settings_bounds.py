"""Settings with bounds refuse a value outside them at start-up, naming the setting (issue 27's
RACON_BACKGROUND_NICE and CREDITS_SETTLE_BATCH_SECONDS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _settings_import(name: str, value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "racon.settings", name: value}
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RACON_BACKGROUND_NICE", "-5"),
        ("RACON_BACKGROUND_NICE", "20"),
        ("RACON_BACKGROUND_NICE", "ten"),
        ("CREDITS_SETTLE_BATCH_SECONDS", "-1"),
        ("CREDITS_SETTLE_BATCH_SECONDS", "61"),
        ("CREDITS_SETTLE_BATCH_SECONDS", "soon"),
    ],
)
def test_a_value_out_of_bounds_is_refused_by_name(name: str, value: str) -> None:
    done = _settings_import(name, value)
    assert done.returncode != 0
    assert f"ImproperlyConfigured: {name}=" in done.stderr and value in done.stderr


def test_values_in_bounds_start() -> None:
    for name, value in (("RACON_BACKGROUND_NICE", "0"), ("CREDITS_SETTLE_BATCH_SECONDS", "0")):
        done = _settings_import(name, value)
        assert done.returncode == 0, done.stderr
