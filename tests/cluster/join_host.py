"""A namespace host that has never seen the repository, running the join line (issue 19).

The host gets a scratch HOME, a working directory outside the checkout, no user site-packages,
no pip cache and a PATH of the system directories plus a python3.12 (tests/join/conftest.py's
clean_env): nothing of the checkout or its venv is reachable from what it runs, except through
the controller's HTTP answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.join import clean_env

from .harness import ROOT, RPC_PORT, Cluster

IP = shutil.which("ip") or "/usr/sbin/ip"


def build_wheelhouse() -> Path:
    """The controller's wheelhouse (scripts/build-wheelhouse.py, cached under ~/.cache/racon):
    the daphne of the cluster serves it, reading the same cache (its HOME is this process's)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build-wheelhouse.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"build-wheelhouse failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def fresh_home(cl: Cluster, host: str) -> Path:
    """The host's scratch HOME (with work/, the directory the line is run from)."""
    home = cl.workdir / "homes" / host
    (home / "work").mkdir(parents=True, exist_ok=True)
    return home


def host_env(cl: Cluster, host: str, home: Path, name: str) -> dict[str, str]:
    """The environment of a clean machine, plus what the agent needs to know of this host (its
    name, the address peers reach it on and its RPC port): nothing from this process."""
    return clean_env(
        home,
        # A machine's own choice of llama.cpp backends travels with it (GPU nodes, README).
        {"RACON_LLAMA_BACKENDS": os.environ["RACON_LLAMA_BACKENDS"]}
        if os.environ.get("RACON_LLAMA_BACKENDS")
        else {},
        RACON_NODE_NAME=name,
        RACON_ADVERTISE_ADDRESS=cl.hosts[host].address,
        RACON_RPC_PORT=str(RPC_PORT),
        GGML_NO_BACKTRACE="1",
    )


def run_join_line(
    cl: Cluster, host: str, line: str, *, home: Path, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """`ip netns exec <host> sh -c '<line>'` from the host's scratch work directory (never the
    checkout), its own session (so the test can stop the agent it execs into)."""
    if str(ROOT) in env.get("PATH", "") or "PYTHONPATH" in env:
        raise AssertionError("the host's PATH and Python path must not reach the checkout")
    with open(log, "ab") as out:
        return subprocess.Popen(
            [IP, "netns", "exec", cl.hosts[host].netns, "sh", "-c", line],
            cwd=home / "work",
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
