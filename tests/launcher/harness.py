"""A real `python -m racon.launcher` in a temporary var dir, and helpers to find its children."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import psutil
from dotenv import dotenv_values

from racon.embedded import free_port
from tests.support.processes import alive, wait_for

ROOT = Path(__file__).resolve().parents[2]
# What the test plugin (racon/testing.py) and pytest-django put in the environment for the
# suite's own Django: the launcher must make its own Redis, database and secrets.
SUITE_ONLY = (
    "REDIS_URL", "CELERY_BROKER_URL", "RACON_EMBEDDED_REDIS", "NODE_ENROLLMENT_SECRET", "AI_API_KEY",
    "CELERY_TASK_ALWAYS_EAGER", "NODE_REDIS_ACL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY",
    "RACON_ADMIN_PASSWORD", "RACON_REDIS_PASSWORD", "PORT", "RACON_CONTROLLER_URL",
)  # fmt: skip
READY_TIMEOUT = 400.0  # migrations and the agent's first start take 20-40 s on 2 cores


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline()[:3])}"
    except psutil.Error:
        return str(p.pid)


@dataclass
class Launcher:
    var: Path
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the launcher exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            return re.compile(pattern).search(self.log(), after)

        try:
            match: re.Match[str] = wait_for(
                found, timeout, f"{pattern!r} in the launcher's log", interval=0.5
            )
            return match
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()[-4000:]}") from None

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in found:
            self.seen.setdefault(p.pid, p)
        return found

    def child(self, match: Callable[[list[str]], bool]) -> psutil.Process | None:
        """The launcher's direct child whose command line matches."""
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        self.descendants()
        for p in kids:
            try:
                if match(p.cmdline()):
                    return p
            except psutil.Error:
                continue
        return None

    def secrets(self) -> dict[str, str | None]:
        return dotenv_values(self.var / ".env.local")

    def health(self) -> int:
        try:
            return httpx.get(f"{self.url}/health", timeout=30).status_code
        except httpx.HTTPError as exc:
            return -1 if isinstance(exc, httpx.TimeoutException) else 0

    def close(self) -> None:
        """Stop it and everything it ever started, whatever state the test left it in."""
        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in alive(self.seen.values()):
            try:
                p.kill()
            except psutil.Error:
                pass
        if self._log is not None:
            self._log.close()


def start_launcher(var: Path, *args: str) -> Launcher:
    """`python -m racon.launcher --agents 1 --no-model` on a free port; not waited for."""
    var.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
    env.update(
        RACON_VAR_DIR=str(var),
        RACON_MODEL_STORE=str(var / "store"),
        PORT=str(port),
        RACON_RPC_PORT=str(free_port()),
        RACON_NO_RPC_WORKER="1",  # no ggml-rpc worker: nothing here needs one
        DAPHNE_PROCESSES="1",
        PYTHONUNBUFFERED="1",
    )
    log_path = var.parent / f"launcher-{port}.log"
    log = open(log_path, "wb")  # closed by Launcher.close
    proc = subprocess.Popen(
        [sys.executable, "-m", "racon.launcher", "--agents", "1", "--no-model", *args],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return Launcher(var=var, port=port, log_path=log_path, proc=proc, _log=log)


def is_agent(cmdline: list[str]) -> bool:
    return any(part.endswith("node-agent") for part in cmdline[:2])


def is_redis(cmdline: list[str]) -> bool:
    return bool(cmdline) and "redis-server" in cmdline[0]
