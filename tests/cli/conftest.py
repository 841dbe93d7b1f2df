from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from racon_cli.main import app
from tests.e2e.harness import Controller

from .live import shared_controller


@pytest.fixture(scope="session")
def live(
    django_db_setup: None,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Controller:
    return shared_controller(request, django_db_blocker, tmp_path_factory)


Run = Callable[..., Result]


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


def one_error_line(result: Result) -> str:
    """The CLI's error contract: a non-zero exit and exactly one line on stderr, starting 'error: '."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code != 0, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="session")
def model_path() -> Path:
    from tests.e2e.harness import smollm2_path

    return smollm2_path()
