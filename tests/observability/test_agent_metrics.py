"""The agent's /metrics endpoint (agent/metrics.py): its figures, its binding, and a port in use."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.metrics import MetricsServer, render, start_metrics_server
from agent.protocol import PROTOCOL_VERSION
from tests.agent.harness import controller, free_port, h, redis_client  # noqa: F401 - fixtures of the real-Agent harness

SNAPSHOT: dict[str, Any] = {
    "state": "READY",
    "node_id": "node-1",
    "node_name": "box",
    "agent_version": "0.1.0",
    "protocol_version": PROTOCOL_VERSION,
    "controller_reachable": True,
    "primaries": ["dep-1"],
    "loading": [],
    "models_loaded": [{"deployment_id": "dep-1", "model": "smollm2"}],
    "jobs": ["job-9"],
    "rpc_worker": {"running": True, "endpoint": "127.0.0.1:50052"},
    "last_job": {
        "job_id": "job-8",
        "tokens_per_s": 41.5,
        "ttft_ms": 180.0,
        "completion_tokens": 64,
    },
    "mem_available": 6 * 1024**3,
    "gpu_free": [10 * 1024**3],
    "cpu_percent": 12.5,
    "commands_total": 7,
    "jobs_finished_total": 3,
    "completion_tokens_total": 150,
}


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def taken_port() -> Iterator[int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield int(s.getsockname()[1])
    s.close()


def test_render_shows_models_rpc_worker_last_job_and_memory() -> None:
    got = parse(render(SNAPSHOT, {"system_used": 9 * 1024**3, "process_tree_rss": 700 * 1024**2}))
    assert got[("racon_agent_state", frozenset({("state", "READY")}))] == 1
    assert got[("racon_agent_state", frozenset({("state", "DRAINING")}))] == 0
    assert got[("racon_agent_models_loaded", frozenset())] == 1
    assert (
        got[
            (
                "racon_agent_model_loaded",
                frozenset({("deployment_id", "dep-1"), ("model", "smollm2")}),
            )
        ]
        == 1
    )
    assert got[("racon_agent_rpc_worker_up", frozenset())] == 1
    assert got[("racon_agent_jobs_running", frozenset())] == 1
    assert got[("racon_agent_last_job_tokens_per_second", frozenset())] == 41.5
    assert got[("racon_agent_last_job_ttft_seconds", frozenset())] == 0.18
    assert got[("racon_agent_memory_used_bytes", frozenset())] == 9 * 1024**3
    assert got[("racon_agent_process_memory_bytes", frozenset())] == 700 * 1024**2
    assert got[("racon_agent_gpu_free_bytes", frozenset({("gpu", "0")}))] == 10 * 1024**3
    assert got[("racon_agent_completion_tokens_total", frozenset())] == 150


def test_render_copes_with_the_bare_snapshot_and_escapes_labels() -> None:
    bare = {
        "state": "DEGRADED",
        "primaries": ["dep-2"],
        "rpc_worker": {},
        "node_name": 'odd "name"\\x',
    }
    text = render(bare, {})
    got = parse(text)
    assert (
        got[("racon_agent_model_loaded", frozenset({("deployment_id", "dep-2"), ("model", "")}))]
        == 1
    )
    assert got[("racon_agent_rpc_worker_up", frozenset())] == 0
    assert "racon_agent_last_job_tokens_per_second" not in text  # unknown until a job finished
    info = [k for k in got if k[0] == "racon_agent_info"][0]
    assert dict(info[1])["node_name"] == 'odd "name"\\x'


def test_the_server_serves_metrics_on_the_given_address_only() -> None:
    server, error = start_metrics_server("127.0.0.1", free_port(), lambda: SNAPSHOT)
    assert server is not None and error is None
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
        resp = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(
            "text/plain; version=0.0.4"
        )
        assert (
            parse(resp.text)[("racon_agent_process_memory_bytes", frozenset())] > 0
        )  # psutil, this process
        assert httpx.get(f"http://127.0.0.1:{server.port}/other", timeout=5).status_code == 404
    finally:
        server.stop()


def test_a_broken_snapshot_answers_500_and_the_server_stays_up() -> None:
    calls = {"n": 0}

    def snapshot() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return SNAPSHOT

    server = MetricsServer("127.0.0.1", 0, snapshot)
    server.start()
    try:
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).status_code == 500
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).status_code == 200
    finally:
        server.stop()


def test_a_port_in_use_is_reported_not_raised(taken_port: int, caplog: Any) -> None:
    with pytest.raises(OSError):
        MetricsServer("127.0.0.1", taken_port, lambda: SNAPSHOT)
    server, error = start_metrics_server("127.0.0.1", taken_port, lambda: SNAPSHOT)
    assert server is None
    assert error is not None and f"metrics port 127.0.0.1:{taken_port} unavailable" in error
    assert any("unavailable" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_an_agent_whose_metrics_port_is_taken_reports_it_and_keeps_serving(
    h: Any,  # noqa: F811 - the fixture imported above
    taken_port: int,
) -> None:
    agent = h.start(h.config(metrics_port=taken_port))
    # Reported to the controller (a non-fatal fault today, see agent/agent.py _start_metrics) ...
    faults = h.controller.wait_for(
        lambda c: [
            r
            for r in c.reports
            if r["kind"] in ("fault", "event") and f"metrics port {taken_port}" in str(r["payload"])
        ]
    )
    assert faults[0]["payload"].get("fatal") in (None, False)
    # ... and the agent runs on: READY, heartbeating, and a job still completes.
    assert agent.wait_ready(10)
    beats = len(h.controller.heartbeats)
    h.controller.wait_for(lambda c: len(c.heartbeats) > beats + 1)
    dep, _ = h.load(agent)
    job = h.job(dep)
    h.send(agent, "run_job", job)
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "completed"


def test_the_metrics_module_imports_no_django() -> None:
    code = "import agent.metrics, sys; assert 'django' not in sys.modules, 'django imported'"
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    )
