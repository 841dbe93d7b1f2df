from __future__ import annotations

from typing import Any

import pytest

from tests.cli.live import shared_controller
from tests.e2e.harness import Controller


@pytest.fixture(scope="session")
def live(
    django_db_setup: None,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Controller:
    return shared_controller(request, django_db_blocker, tmp_path_factory)
