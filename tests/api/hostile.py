"""A hostile primary played at the Redis edge, for the live /v1 trust tests (billing, release).

It takes the node's run_job commands and writes each job's stream through the agent's own stream
writer (agent/runtime/stream.DirectStreamWriter, the same transaction the real agent uses), with the
entries a test chooses: a forged ``n``, or more tokens than the job's ``max_tokens``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, cast

import httpx

from agent.protocol import StreamEntry, node_queue_key
from agent.runtime.stream import DirectStreamWriter, entry
from racon.redis import get_redis

from .live import Daphne

OPERATOR = {"Authorization": "Bearer test-operator-key"}

# What the hostile primary writes for a job: a function of its writer.
Script = Callable[[DirectStreamWriter], None]


class HostilePrimary:
    """Takes the node's run_job commands and writes each job's stream by ``script``."""

    def __init__(self, node_id: str, script: Script) -> None:
        self.node_id, self.script = node_id, script
        self.jobs: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HostilePrimary:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        r = get_redis()
        while not self._stop.is_set():
            got = r.blpop([node_queue_key(self.node_id)], timeout=1)
            if got is None:
                continue
            cmd = json.loads(got[1])
            if cmd["kind"] != "run_job":
                continue
            job_id = cmd["payload"]["job_id"]
            self.jobs.append(job_id)
            w = DirectStreamWriter(r, job_id, threading.Event(), node_id=self.node_id, attempt=1)
            self.script(w)


def forged(w: DirectStreamWriter, text: str, ids: list[int], **fields: str) -> None:
    """One chunk entry as the agent writes it, with fields the node chose over it."""
    chosen: dict[str, object] = dict(entry(w._next(), "chunk", text, ids=ids, attempt=w.attempt))
    chosen.update(fields)
    w._write([cast(StreamEntry, chosen)])  # a node's stream is its claim, not the protocol


def done(w: DirectStreamWriter, finish: str, completion_tokens: int) -> None:
    w.done(finish, {"prompt_tokens": 5, "completion_tokens": completion_tokens})  # type: ignore[typeddict-item]


def post(daphne: Daphne, **body: Any) -> httpx.Response:
    return httpx.post(
        daphne.url + "/v1/completions",
        json={"model": "live-model", "prompt": "Say hello.", **body},
        headers=OPERATOR,
        timeout=60,
    )
