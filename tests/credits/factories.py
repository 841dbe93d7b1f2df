"""Moved to tests/factories.py (the suite's one set of factories); this name stays only until the
last importers switch."""

from __future__ import annotations

from tests.factories import (
    ModelFactory,
    ModelFileFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
    plan_for,
)

__all__ = [
    "ModelFactory",
    "ModelFileFactory",
    "deployment_for",
    "funded_account",
    "job_finish",
    "job_for",
    "plan_for",
]
