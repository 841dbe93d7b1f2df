"""A machine with no Python at all, on this one: a mount namespace (`unshare -m`) in which every
Python interpreter and library of this machine is masked with bind mounts (issue 26).

Masked: the system's (/usr/bin/python*, /usr/lib/python3*, /usr/local/...), pyenv's (~/.pyenv),
the checkout's .venv, and ~/.cache/racon, whose llama.cpp build a stray RPATH could reach.
Nothing outside the namespace changes; the masks end with the process.
"""

from __future__ import annotations

import glob
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What build-bundle.sh uses: the cached build's tarball is the last line it prints.
BUILD_BUNDLE = ROOT / "scripts" / "build-bundle.sh"


def cache_dir() -> Path:
    return Path(os.environ.get("RACON_CACHE") or Path.home() / ".cache" / "racon")


def python_masks() -> tuple[list[str], list[str]]:
    """(directories, files) to hide: every Python this machine has."""
    dirs = [
        str(Path.home() / ".pyenv"),
        str(ROOT / ".venv"),
        str(cache_dir()),
        str(Path(sys.base_prefix)),
        *glob.glob("/usr/lib/python3*"),
        *glob.glob("/usr/local/lib/python3*"),
        *glob.glob("/opt/python*"),
    ]
    files = {
        os.path.realpath(p)
        for p in glob.glob("/usr/bin/python*") + glob.glob("/usr/local/bin/python*")
    }
    real = {os.path.realpath(d) for d in dirs if os.path.isdir(d)} - {"/", "/usr"}
    # A directory inside another masked one is hidden already (and its mount point is gone).
    keep_dirs = sorted(d for d in real if not any(d.startswith(o + "/") for o in real))
    return keep_dirs, sorted(f for f in files if os.path.isfile(f))


def without_python(argv: list[str], empty_dir: Path) -> list[str]:
    """argv, run in a new mount namespace where every Python is masked (root only)."""
    empty_dir.mkdir(parents=True, exist_ok=True)
    dirs, files = python_masks()
    q = shlex.quote
    steps = [f"mount --bind {q(str(empty_dir))} {q(d)}" for d in dirs]
    steps += [f"mount --bind /dev/null {q(f)}" for f in files]
    script = "set -e; " + "; ".join(steps) + '; exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def build_bundle() -> Path:
    """The controller's agent bundle for this platform (scripts/build-bundle.sh; cached, and
    published where the controller serves it)."""
    proc = subprocess.run(
        [str(BUILD_BUNDLE)], capture_output=True, text=True, check=False, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/build-bundle.sh failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])
