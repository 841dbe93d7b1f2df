"""KV cache ownership with real agents: a conversation's turns follow the replica holding its
prefix, and after that replica's node drains, they follow the new owner (state dropped, with
an event: state transfer is switched off here; tests/e2e/test_kv_transfer.py moves it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from racon.redis import get_redis

from .harness import AgentProc, Controller, start_agent, stop_agent, wait_for
from .test_cluster import make_account_with_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-kv"


def test_turns_follow_the_owner_and_the_new_owner_after_a_drain(
    controller: Controller, model_path: Path, tmp_path: Path
) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    try:
        os.link(model_path, models_dir / model_path.name)
    except OSError:
        shutil.copy(model_path, models_dir / model_path.name)
    agents: list[AgentProc] = []
    try:
        for name in ("kv-a", "kv-b"):
            acct_id, _ = make_account_with_key(f"owner-{name}")
            tok = controller.post("/api/admin/tokens", {"label": name, "account": acct_id})
            assert tok.status_code == 201, tok.text
            agents.append(
                start_agent(controller, tok.json()["token"], name, tmp_path, models_dir=models_dir)
            )

        def ready_nodes() -> dict[str, Any] | None:
            got = {
                n["name"]: n
                for n in controller.get("/api/admin/nodes?state=READY").json()
                if n["name"].startswith("kv-")
            }
            return got if len(got) == 2 else None

        nodes = wait_for(ready_nodes, 90, "two READY nodes")
        created = controller.post("/api/admin/models", {"path": str(model_path), "name": MODEL})
        assert created.status_code == 201, created.text
        deps: dict[str, str] = {}
        for name in ("kv-a", "kv-b"):
            dep = controller.post(
                "/api/admin/deployments",
                {"model": MODEL, "nodes": [name], "n_ctx": 1024, "n_parallel": 2},
            )
            assert dep.status_code == 202, dep.text
            deps[name] = dep.json()["id"]

        def ready(dep_id: str) -> bool:
            d = controller.get(f"/api/admin/deployments/{dep_id}").json()
            assert d["state"] not in ("FAILED", "STOPPED"), d
            return bool(d["state"] == "READY")

        for dep_id in deps.values():
            wait_for(lambda dep_id=dep_id: ready(dep_id), 180, "both replicas READY")
        _, key = make_account_with_key("kv-consumer")
        headers = {"Authorization": f"Bearer {key}"}
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a terse assistant."}
        ]

        def turn(i: int) -> str:
            messages.append({"role": "user", "content": f"Turn {i}: name a colour and a number."})
            resp = httpx.post(
                controller.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0},
                headers=headers,
                timeout=180,
            )
            assert resp.status_code == 200, resp.text
            messages.append(
                {"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]}
            )
            return str(resp.headers["x-racon-deployment-id"])

        owner = turn(1)
        # Every follow-up goes to the owner (least-loaded routing would split them at random).
        assert [turn(i) for i in range(2, 6)] == [owner] * 4
        metrics = controller.get("/metrics").text
        hits = [ln for ln in metrics.splitlines() if ln.startswith("racon_kv_prefix_hits_total")]
        assert hits and float(hits[0].split()[-1]) >= 4, hits

        # The owner's node drains: the next turn goes to the other replica, the old state is
        # dropped with an event, and the turn after that follows the new owner.
        owner_node = next(n for n, d in deps.items() if d == owner)
        other = next(d for d in deps.values() if d != owner)
        get_redis().set("racon:kv:transfer", "off")  # the drop path (the Redis is flushed after)
        drained = controller.post(f"/api/admin/nodes/{nodes[owner_node]['id']}/drain")
        assert drained.status_code == 200, drained.text
        assert turn(6) == other
        assert turn(7) == other
        old_events = controller.get(f"/api/admin/deployments/{owner}").json()["events"]
        assert any(e["kind"] == "KV_STATE_DROPPED" for e in old_events), old_events
        new_events = controller.get(f"/api/admin/deployments/{other}").json()["events"]
        moved = [e for e in new_events if e["kind"] == "KV_OWNERSHIP_MOVED"]
        assert len(moved) == 1 and moved[0]["data"]["from_deployment"] == owner, new_events
    finally:
        for agent in agents:
            stop_agent(agent)
