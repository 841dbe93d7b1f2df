"""Agents played at the Redis edge: a thread answers the commands on nodes' queues the way an
agent does, with command_result reports through the controller's own report_accept."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any, Self

from django.utils import timezone

from agent.protocol import node_queue_key
from apps.jobs.reports import report_accept
from apps.models_repo.models import ModelFile
from racon.redis import get_redis


class FakeAgents:
    """Answers commands on the nodes' Redis queues the way agents do (command_result reports)."""

    def __init__(
        self,
        node_ids: list[str],
        fail_load_on: set[str] | None = None,
        liars: set[str] | None = None,
    ) -> None:
        self.node_ids = node_ids
        self.fail_load_on = fail_load_on or set()
        self.liars = liars or set()  # claim files they do not hold: wrong hash-challenge answers
        self.seen: list[tuple[str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        r = get_redis()
        while not self.stop.is_set():
            got = r.blpop([node_queue_key(n) for n in self.node_ids], timeout=1)
            if got is None:
                continue
            node_id = got[0].split(":")[2]
            cmd = json.loads(got[1])
            self.seen.append((node_id, cmd["kind"]))
            payload = self.answer(node_id, cmd)
            report_accept(
                node_id=node_id,
                report={
                    "id": f"r-{time.time_ns()}",
                    "kind": "command_result",
                    "command_id": cmd["id"],
                    "payload": payload,
                },
                now=timezone.now(),
            )
        from django.db import connection

        connection.close()  # this thread's own connection

    def answer(self, node_id: str, cmd: dict[str, Any]) -> dict[str, Any]:
        """The command_result payload an agent would send."""
        ok = not (cmd["kind"] == "load_primary" and node_id in self.fail_load_on)
        payload: dict[str, Any] = {"ok": ok, "command": cmd["kind"]}
        if not ok:
            payload["error"] = "RPC worker 127.0.0.1:1 unreachable"
        if cmd["kind"] == "load_primary" and ok:
            payload["assignment"] = [{"device": "CPU", "n_layers": 30}]
        if cmd["kind"] == "hash_challenge":
            payload["digest"] = self._digest(cmd["payload"], honest=node_id not in self.liars)
        if cmd["kind"] == "fetch_model":
            payload["path"] = f"/models/{cmd['payload']['file_name']}"
        return payload

    @staticmethod
    def _digest(p: dict[str, Any], *, honest: bool) -> str:
        """An honest node holds the store's bytes; a liar answers without them."""
        store = ModelFile.objects.get(sha256=p["sha256"]).store_path
        with open(store, "rb") as f:
            f.seek(p["offset"])
            data = f.read(p["length"]) if honest else b"not the file"
        return hashlib.sha256(bytes.fromhex(p["nonce"]) + data).hexdigest()

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
