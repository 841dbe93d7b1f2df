"""The CLI against a real agent and SmolLM2: deploy (waiting for READY) and a streamed chat."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Controller, start_agent, stop_agent, wait_for
from tests.support.cli import Run

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_deploy_waits_for_ready_then_chat_streams_tokens(
    racon: Run, live: Controller, tmp_path: Path, model_path: Path
) -> None:
    res = racon("tokens", "create", "cli-node", "--json")
    token = json.loads(res.stdout)["token"]
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    shutil.copy(model_path, models_dir / model_path.name)
    agent = start_agent(live, token, "cli-1", tmp_path, models_dir=models_dir)
    try:

        def ready() -> Any:
            nodes = json.loads(racon("nodes", "ls", "--state", "READY", "--json").stdout)
            return [n for n in nodes if n["name"] == "cli-1"]

        wait_for(ready, 60, "the node to be READY")
        assert racon("models", "add", str(model_path), "--name", "smollm2").exit_code == 0
        res = racon("deploy", "smollm2", "--nodes", "cli-1", "--n-ctx", "1024")
        assert res.exit_code == 0, res.output
        assert "is READY on cli-1" in res.stdout
        deps = json.loads(racon("deployments", "ls", "--state", "READY", "--json").stdout)
        assert len(deps) == 1 and deps[0]["node_names"] == ["cli-1"]

        res = racon(
            "chat", "smollm2", "-m", "Say hello.", "--max-tokens", "8", "--temperature", "0"
        )
        assert res.exit_code == 0, res.output
        assert res.stdout.strip() and "tokens," in res.stderr and "tok/s" in res.stderr
        # Piped stdin: one turn per line, the conversation carried over.
        res = racon(
            "chat",
            "smollm2",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            input="Hi\nAnd again?\n/exit\n",
        )
        assert res.exit_code == 0 and res.stderr.count("tokens,") == 2
        jobs = json.loads(racon("jobs", "ls", "--state", "completed", "--json").stdout)
        assert len(jobs) == 3 and all(j["node_names"] == ["cli-1"] for j in jobs)
        assert "cli-1" in racon("jobs", "show", jobs[0]["id"][:8]).stdout

        res = racon("deployments", "stop", deps[0]["id"][:8])
        assert res.exit_code == 0 and "STOPPED" in res.stdout
    finally:
        stop_agent(agent)
