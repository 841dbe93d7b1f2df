from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from racon_cli.main import app
from tests.e2e.harness import Controller
from tests.support.cli import Run

from .live import shared_controller


@pytest.fixture(scope="session")
def live(
    django_db_setup: None,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Controller:
    return shared_controller(request, django_db_blocker, tmp_path_factory)


@pytest.fixture
def racon(live: Controller, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Run the real CLI in-process against the live controller: racon("nodes", "ls", "--json")."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for var in ("RACON_URL", "RACON_API_KEY", "RACON_CONFIG"):
        monkeypatch.delenv(var, raising=False)

    def run(
        *args: str, key: str | None = None, url: str | None = None, input: str | None = None
    ) -> Result:
        env = {
            "RACON_URL": url or live.url,
            "RACON_API_KEY": live.api_key if key is None else key,
            "RACON_CONFIG": str(tmp_path / "config.json"),
            "COLUMNS": "200",
        }
        return runner.invoke(app, list(args), env=env, input=input, catch_exceptions=False)

    return run


@pytest.fixture(scope="session")
def model_path() -> Path:
    from tests.e2e.harness import smollm2_path

    return smollm2_path()
