"""Smoke tests for bench/: each bench runs end to end in its tiny mode, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(
    script: str, args: list[str], tmp_path: Path, timeout: float = 840
) -> subprocess.CompletedProcess[str]:
    """Run bench/<script> with its temporary files under tmp_path; return the finished process."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env.pop(
        "DJANGO_SETTINGS_MODULE", None
    )  # the bench configures its own Django, database and Redis
    env.pop("DATABASE_URL", None)
    # Each bench starts its own embedded Redis: nothing shared is flushed, runs cannot collide.
    env.pop("REDIS_URL", None)
    env.pop("CELERY_BROKER_URL", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def processes_under(path: Path) -> list[str]:
    """Processes of ours whose command line or environment mentions path (left running = a leak)."""
    needle = str(path).encode()
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            if (
                needle in (pid_dir / "cmdline").read_bytes()
                or needle in (pid_dir / "environ").read_bytes()
            ):
                found.append(f"{pid_dir.name}: {(pid_dir / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return found
