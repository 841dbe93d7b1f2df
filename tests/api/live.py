"""A real daphne on the test database and Redis, and a fake primary played at the Redis edge.

The controller side is real end to end (HTTP, auth, admission, dispatch, the stream follower,
settlement in eager Celery); only the node is played: a thread takes run_job commands from the
node's queue and writes the job's stream in the protocol's format (docs/design/serving.md).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.protocol import job_cancel_key, job_stream_key, node_queue_key
from tests.support import processes, timing

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PORTS = range(18100, 18200)


def port_in_range() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 18100-18199")


def database_url() -> str:
    from tests.e2e.harness import database_url as url

    return url()


@dataclass
class Daphne:
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def run_daphne(workdir: Path, **overrides: str) -> Iterator[Daphne]:
    """One daphne process (no Celery worker: tasks run eagerly in it, so no sweep moves nodes)."""
    port = port_in_range()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "CELERY_TASK_ALWAYS_EAGER": "true",
        "RACON_VAR_DIR": str(workdir / "var"),
        "DEBUG": "false",
        "LOG_FORMAT": "text",
        "LOG_LEVEL": "INFO",
        "SECRET_KEY": "live-test-secret-key-" + "k" * 40,
        **overrides,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    log_path = workdir / "daphne.log"
    proc = processes.start(
        [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port), "racon.asgi:application"],
        log_path=log_path,
        env=env,
    )
    d = Daphne(url=f"http://127.0.0.1:{port}", log_path=log_path)

    def up() -> bool:
        try:
            httpx.get(d.url + "/health", timeout=2)  # 503 without a Celery worker: still up
        except httpx.HTTPError:
            return False
        return True

    try:
        processes.wait_running(proc, up, timing.scaled(60), "daphne up", log_path=log_path)
        yield d
    finally:
        processes.stop(proc)


@dataclass
class FakePrimary:
    """Serves run_job for one node: ``hold`` jobs wait for ``release(job)``, the rest finish at once."""

    node_id: str
    hold: int = 0
    started: list[str] = field(default_factory=list)
    _release: dict[str, threading.Event] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> FakePrimary:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for ev in self._release.values():
            ev.set()
        for t in self._threads:
            t.join(timeout=10)

    def release(self, job_id: str) -> None:
        self._release[job_id].set()

    def wait_started(self, n: int, timeout: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.started) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"the primary got {len(self.started)} jobs, expected {n}")
            time.sleep(0.02)
        return list(self.started)

    def _run(self) -> None:
        from racon.redis import get_redis

        r = get_redis()
        while not self._stop.is_set():
            got = r.blpop([node_queue_key(self.node_id)], timeout=1)
            if got is None:
                continue
            cmd = json.loads(got[1])
            if cmd["kind"] != "run_job":
                continue
            job_id = cmd["payload"]["job_id"]
            ev = threading.Event()
            if self.hold > 0:
                self.hold -= 1
            else:
                ev.set()
            self._release[job_id] = ev
            self.started.append(job_id)
            t = threading.Thread(target=self._serve, args=(job_id, ev), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, job_id: str, release: threading.Event) -> None:
        from racon.redis import get_redis

        r = get_redis()
        key = job_stream_key(job_id, self.node_id)
        r.xadd(
            key,
            {
                "seq": "0",
                "attempt": "1",
                "type": "chunk",
                "text": "Hello",
                "ids": "[9906]",
                "n": "1",
            },
        )
        while not release.wait(0.05):
            if r.exists(job_cancel_key(job_id, self.node_id)) or self._stop.is_set():
                r.xadd(
                    key,
                    {
                        "seq": "1",
                        "attempt": "1",
                        "type": "done",
                        "text": "",
                        "finish_reason": "cancelled",
                        "usage": "{}",
                    },
                )
                return
        r.xadd(
            key,
            {
                "seq": "1",
                "attempt": "1",
                "type": "chunk",
                "text": " there.",
                "ids": "[1080, 13]",
                "n": "2",
            },
        )
        usage = json.dumps(
            {"prompt_tokens": 12, "completion_tokens": 3, "ttft_ms": 5.0, "tokens_per_s": 100.0}
        )
        r.xadd(
            key,
            {
                "seq": "2",
                "attempt": "1",
                "type": "done",
                "text": "",
                "finish_reason": "stop",
                "usage": usage,
            },
        )
