from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Controller, run_controller, smollm2_path


@pytest.fixture(scope="session")
def model_path() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def controller(
    django_db_setup: None,
    django_db_blocker: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Controller]:
    """One live controller (daphne + Celery worker and beat) for the e2e session."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        with run_controller(tmp_path_factory.mktemp("controller")) as ctl:
            yield ctl
