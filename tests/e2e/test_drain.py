"""Drain with real agents: a model served on alpha moves to beta while a stream runs on alpha.

The stream completes, the next requests are served by the replacement on beta, alpha reaches
DRAINED with NODE_DRAINED written after its last job finished, and no job is lost.
"""

from __future__ import annotations

import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from .harness import Controller, agents_serving_model, chat_ok, consumer_headers, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROMPT = [{"role": "user", "content": "Count slowly from one to forty, in words."}]


def _at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["created_at"].replace("Z", "+00:00"))


def test_a_drain_moves_the_model_first_lets_the_stream_finish_and_loses_no_job(
    controller: Controller, model_path: Path, tmp_path: Path
) -> None:
    names = ("drain-a", "drain-b")
    started = agents_serving_model(controller, model_path, tmp_path, names, "smollm2-drain")
    with started as (_, nodes):
        a_id = nodes["drain-a"]["id"]
        dep = controller.post(
            "/api/admin/deployments", {"model": "smollm2-drain", "nodes": ["drain-a"], "n_ctx": 512}
        )
        assert dep.status_code == 202, dep.text
        old_id = dep.json()["id"]

        def state_of(dep_id: str) -> str:
            d = controller.get(f"/api/admin/deployments/{dep_id}").json()
            assert d["state"] not in ("FAILED",), d
            return str(d["state"])

        wait_for(lambda: state_of(old_id) == "READY", 180, "the deployment on drain-a to be READY")
        headers = consumer_headers("drain-consumer")
        body = {
            "model": "smollm2-drain",
            "messages": PROMPT,
            "max_tokens": 96,
            "temperature": 0,
            "stream": True,
        }

        # A stream runs on drain-a; the drain is asked for once its first tokens arrived.
        first_chunk = threading.Event()
        streamed: dict[str, Any] = {"chunks": 0, "done": False, "error": None}

        def stream() -> None:
            try:
                with (
                    httpx.Client(timeout=180) as c,
                    connect_sse(
                        c,
                        "POST",
                        controller.url + "/v1/chat/completions",
                        json=body,
                        headers=headers,
                    ) as sse,
                ):
                    streamed["job"] = sse.response.headers.get("x-racon-job-id")
                    streamed["nodes"] = sse.response.headers.get("x-racon-nodes")
                    for ev in sse.iter_sse():
                        if ev.data == "[DONE]":
                            streamed["done"] = True
                            break
                        if '"error"' in ev.data[:20]:
                            streamed["error"] = ev.data
                        streamed["chunks"] += 1
                        first_chunk.set()
            except Exception as exc:  # reported by the assertions below
                streamed["error"] = repr(exc)
            finally:
                first_chunk.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(120), "no first chunk"
        drained = controller.post(f"/api/admin/nodes/{a_id}/drain")
        assert drained.status_code == 200 and drained.json()["state"] == "DRAINING", drained.text
        t.join(240)
        assert streamed["done"] and streamed["error"] is None and streamed["chunks"] > 1, streamed
        assert streamed["nodes"] == "drain-a"

        # The replacement on drain-b serves the next requests.
        def replacement() -> str | None:
            events = controller.get(f"/api/admin/deployments/{old_id}").json()["events"]
            moved = [e for e in events if e["kind"] == "DEPLOYMENT_MIGRATING"]
            return moved[0]["data"]["replacement"] if moved else None

        new_id = wait_for(replacement, 30, "a replacement deployment")
        wait_for(lambda: state_of(new_id) == "READY", 180, "the replacement to be READY")
        served = []
        for _ in range(2):
            resp = chat_ok(controller, headers, {**body, "stream": False, "max_tokens": 8})
            assert resp.headers["x-racon-nodes"] == "drain-b"
            served.append(resp.headers["x-racon-job-id"])

        # drain-a is DRAINED, NODE_DRAINED came after its last job finished; the old deployment stopped.
        wait_for(
            lambda: controller.get(f"/api/admin/nodes/{a_id}").json()["state"] == "DRAINED",
            60,
            "drain-a to be DRAINED",
        )
        assert state_of(old_id) == "STOPPED"
        node_events = controller.get(f"/api/admin/nodes/{a_id}").json()["events"]
        drained_events = [e for e in node_events if e["kind"] == "NODE_DRAINED"]
        assert len(drained_events) == 1
        job = controller.get(f"/api/admin/jobs/{streamed['job']}").json()
        assert job["state"] == "COMPLETED", job
        completed = [e for e in job["events"] if e["kind"] == "JOB_COMPLETED"]
        assert completed and _at(drained_events[0]) >= _at(completed[0])
        # Zero lost jobs: every job of the model completed.
        for job_id in [streamed["job"], *served]:
            assert controller.get(f"/api/admin/jobs/{job_id}").json()["state"] == "COMPLETED"
