"""A test whose part (a package, a build, a device) is missing: skipped outside CI with one line
naming the step that installs it, failed under CI=true, where nothing may skip (CLARIFICATIONS)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(why: str, *, under_ci: str = "") -> NoReturn:
    """Skip with ``why``; under CI fail with ``why`` and ``under_ci`` (what should have run)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why} {under_ci}".strip())
    pytest.skip(why)
