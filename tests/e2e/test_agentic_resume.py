"""The engine contract failover relies on under a grammar (docs/design/serving.md, "Failover under
a grammar"): the real llama-server and SmolLM2, driven the way agent/runtime/server.py does.

A JSON-schema'd answer cut after a few tokens and resumed from their token ids, with their text
as ``generation_prompt``, continues the same JSON; without it the grammar starts over mid-output.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.runtime.server import _completion_body, find_llama_server, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            str(find_llama_server()),
            *("-m", str(model_path), "--host", "127.0.0.1", "--port", str(port)),
            *("-np", "1", "-c", "1024", "-t", "1", "--jinja", "--no-webui", "--poll", "0"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + path, json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _run(url: str, job: dict[str, Any], prompt: Any) -> tuple[str, list[int]]:
    body = {**_completion_body(job, prompt), "stream": False}
    body.pop("generation_prompt", None)
    if job.get("generation_prompt"):
        body["generation_prompt"] = job["generation_prompt"]
    out = _post(url, "/completion", body)
    return str(out["content"]), [int(t) for t in out.get("tokens") or []]


def test_a_resumed_attempt_under_a_json_schema_continues_the_same_json(engine: str) -> None:
    messages = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
    prompt = _post(engine, "/apply-template", {"messages": messages})["prompt"]
    job = {"max_tokens": 60, "temperature": 0.0, "json_schema": SCHEMA}
    whole, ids = _run(engine, job, prompt)
    assert set(json.loads(whole)) == {"name", "age"}
    cut = 5
    assert len(ids) > cut
    streamed = _post(engine, "/detokenize", {"tokens": ids[:cut]})["content"]
    rest, _ = _run(engine, {**job, "generation_prompt": streamed}, [prompt, *ids[:cut]])
    assert json.loads(streamed + rest) == json.loads(whole)
    # Without the generation prompt the grammar starts over: not one JSON document.
    restart, _ = _run(engine, job, [prompt, *ids[:cut]])
    with pytest.raises(ValueError):
        json.loads(streamed + restart)
