"""The vertical slice on real parts: controller, one agent, SmolLM2, a chat through the OpenAI SDK."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import openai
import pytest

from .harness import Controller, start_agent, stop_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_one_node_serves_a_chat_through_the_openai_sdk(
    controller: Controller, model_path: Path, tmp_path: Path
) -> None:
    tok = controller.post("/api/admin/tokens", {"label": "slice"}).json()
    assert "node-agent --foreground" in tok["command"]
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    shutil.copy(model_path, models_dir / model_path.name)
    agent = start_agent(controller, tok["token"], "slice-1", tmp_path, models_dir=models_dir)
    try:
        wait_for(
            lambda: [
                n
                for n in controller.get("/api/admin/nodes?state=READY").json()
                if n["name"] == "slice-1"
            ],
            60,
            "the node to be READY",
        )
        reg = controller.post("/api/admin/models", {"path": str(model_path), "name": "smollm2"})
        assert reg.status_code == 201, reg.text
        dep = controller.post("/api/admin/deployments", {"model": "smollm2", "n_ctx": 1024})
        assert dep.status_code == 202, dep.text
        dep_id = dep.json()["id"]

        def ready() -> Any:
            d = controller.get(f"/api/admin/deployments/{dep_id}").json()
            assert d["state"] not in ("FAILED", "STOPPED"), d
            return d if d["state"] == "READY" else None

        wait_for(ready, 120, "the deployment to be READY")
        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=controller.api_key)
        resp = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=12,
            temperature=0,
        )
        assert resp.object == "chat.completion"
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content
        assert resp.usage is not None and resp.usage.completion_tokens > 0
        job = controller.get("/api/admin/jobs?state=COMPLETED").json()
        assert len(job) == 1 and job[0]["completion_tokens"] == resp.usage.completion_tokens
    finally:
        stop_agent(agent)
        print(agent.log()[-4000:])
