from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    AgentProc,
    Controller,
    StartAgents,
    agents_serving_model,
    run_controller,
    shared,
    smollm2_path,
)


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
        with run_controller(tmp_path_factory.mktemp("controller")) as ctl, shared(ctl):
            yield ctl


@pytest.fixture
def serving_agents(
    controller: Controller,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    django_db_blocker: Any,
) -> Iterator[StartAgents]:
    """For a fixture that sets up a cluster: start(label, names, model) runs agents_serving_model
    (tests/e2e/harness.py) in a new ``label`` directory and returns what it yields. The database
    stays unblocked from then on (those fixtures and their tests read the ORM); the agents are
    stopped at teardown."""
    with ExitStack() as stack:

        def start(
            label: str, names: tuple[str, ...], model: str
        ) -> tuple[dict[str, AgentProc], dict[str, dict[str, Any]]]:
            stack.enter_context(django_db_blocker.unblock())
            workdir = tmp_path_factory.mktemp(label)
            return stack.enter_context(
                agents_serving_model(controller, model_path, workdir, names, model)
            )

        yield start
