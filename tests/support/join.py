"""A machine that has never seen the repository, for the join tests (tests/join, tests/cluster):
a clean environment and a system Python outside the venv."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.support.unavailable import unavailable

ROOT = Path(__file__).resolve().parents[2]


def system_python312() -> str:
    """A Python 3.12+ that is not the repository's venv (scripts/find-python.sh picks it)."""
    found = subprocess.run(
        [str(ROOT / "scripts/find-python.sh")], capture_output=True, text=True, check=False
    ).stdout.strip()
    path = os.path.realpath(found) if found else ""
    if not path or path.startswith(str(ROOT)):
        unavailable("no system Python 3.12+ outside the repository's venv: scripts/find-python.sh")
    return path


def clean_env(
    home: Path,
    env_extra: Mapping[str, str] | None = None,
    *,
    with_python: bool = True,
    **extra: str,
) -> dict[str, str]:
    """A machine that has never seen the repository: scratch HOME, no user site-packages, no pip
    cache, a PATH with only the system directories (and a python3.12 when asked); ``env_extra``
    and ``extra`` are added to it."""
    bin_dir = home / ".bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if with_python:
        link = bin_dir / "python3.12"
        if not link.exists():
            link.symlink_to(system_python312())
    env = {
        "HOME": str(home),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONNOUSERSITE": "1",
        "PIP_NO_CACHE_DIR": "1",
        "LANG": "C.UTF-8",
        "TMPDIR": str(home / "tmp"),
    }
    (home / "tmp").mkdir(exist_ok=True)
    # Neither /usr/bin/python3 (3.11 here) nor anything else in PATH may be 3.12+ without it.
    if not with_python:
        for name in ("python3", "python3.12", "python3.13"):
            found = shutil.which(name, path=env["PATH"])
            if (
                found
                and subprocess.run(
                    [found, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"], check=False
                ).returncode
                == 0
            ):
                pytest.skip(f"{found} is Python 3.12+: cannot simulate a machine without it")
    env.update(env_extra or {})
    env.update(extra)
    return env
