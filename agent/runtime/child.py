"""Helpers shared by the agent's child processes (RPC worker, primary)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO


def watch_parent(interval: float = 0.5) -> None:
    """Exit when the agent that started us is gone.

    A child blocked inside ggml never reads its pipes, so it cannot notice EOF; and
    PR_SET_PDEATHSIG fires when the *thread* that forked exits, which would kill healthy children
    started from short-lived threads. Polling getppid() is simple and always right.
    """
    parent = os.getppid()

    def run() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=run, name="watch-parent", daemon=True).start()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Without it ggml starts gdb on abort to print a backtrace: slow and noisy (FACTS.md).
    env["GGML_NO_BACKTRACE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The child runs `python -m agent.runtime...`: make this very agent importable whatever the cwd.
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def spawn(
    module: str,
    args: list[str],
    *,
    log_path: Path,
    with_stdin: bool = False,
) -> tuple[subprocess.Popen[bytes], IO[str]]:
    """Start `python -m module` with stdout/stderr appended to log_path and a message pipe.

    Returns the process and the read end of the pipe on which it writes JSON lines. The child
    gets the write end's fd number as `--msg-fd`. EOF on the pipe means the child is gone.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    try:
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args, "--msg-fd", str(w)],
                stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                pass_fds=(w,),
                env=child_env(),
                close_fds=True,
            )
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return proc, os.fdopen(r, "r", encoding="utf-8", errors="replace")


def log_tail(path: Path, lines: int = 20, max_bytes: int = 16384) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [ln for ln in data.splitlines() if ln.strip()][-lines:]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> int | None:
    """SIGTERM, then SIGKILL after `timeout`. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def readline_timeout(f: IO[str], timeout: float) -> str:
    """One line from a child's message pipe, or "" on EOF or when nothing came within timeout."""
    ready, _, _ = select.select([f], [], [], timeout)
    if not ready:
        return ""
    return f.readline()
