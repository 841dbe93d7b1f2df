"""Starting, waiting for and stopping the processes a test runs (daphne, Celery, agents, the
launcher, a join line): one way for every harness.

A process is started in a session of its own, so that stopping it stops its whole group (a
launcher's children, an agent's llama-server); its output goes to a log file the test can show
when it fails. Waits poll a predicate until a deadline and fail with what they waited for and the
last value seen; their bounds come from the caller (tests/support/timing.py scales them for a
busy machine), never from an idle one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]


# Ports for the processes tests start: below the kernel's ephemeral range (32768-60999 here, see
# /proc/sys/net/ipv4/ip_local_port_range), where every outgoing connection takes its local port.
# A port from bind(0) comes from that range, and a busy suite's connections took one between the
# choice and the agent's own bind (a fresh clone's CI: "cannot open the RPC tunnel on
# 127.0.0.1:48415: address already in use", so the node never measured its link).
PORT_RANGE = range(20000, 32768)
_handed: set[int] = set()  # never the same port twice in one run


def free_port(host: str = "127.0.0.1") -> int:
    """A port no process holds now, outside the ephemeral range; free until someone binds it."""
    for _ in range(500):
        port = random.choice(PORT_RANGE)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # the range is taken: what the kernel hands out
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    stdin: Any = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, stdout and stderr written to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            start_new_session=True,
        )


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes
    (AssertionError naming ``what`` and the last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def wait_running(
    proc: subprocess.Popen[bytes],
    ready: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    log_path: Path | None = None,
    interval: float = 0.2,
) -> Any:
    """``wait_for(ready)``, failing at once (with the log's tail) if ``proc`` exits first."""

    def check() -> Any:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path else ""
            raise AssertionError(f"{what}: the process exited with {proc.returncode}\n{tail}")
        return ready()

    return wait_for(check, timeout, what, interval)


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    """Signal ``proc``'s process group; SIGKILL it after ``timeout``. Idempotent."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(timeout=5)


def group_gone(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """Wait until no process of ``proc``'s group is left (a stopped Celery worker's pool children
    outlive their parent briefly); SIGKILL what is still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = alive(p for p in psutil.process_iter() if _pgid(p) == proc.pid)
        if not left:
            return
        if time.monotonic() > deadline:
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(left, timeout=5)
            return
        time.sleep(0.05)


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The ones still running; a zombie (dead, not yet reaped by init) counts as gone."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
