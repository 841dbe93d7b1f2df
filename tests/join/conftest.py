"""Fixtures of the join tests: the real wheelhouse (built once per session) and a clean machine."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.join import ROOT, clean_env  # noqa: F401 - tests/cluster imports clean_env from here


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """The controller's wheelhouse (scripts/build-wheelhouse.py), cached in ~/.cache/racon: the
    first build takes minutes only when llama.cpp itself must be compiled."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build-wheelhouse.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Path]:
    """A scratch HOME, with a working directory outside the checkout."""
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    yield home
