"""One structured log format: JSON lines in production, readable text in development, with context."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from racon.logging import ContextFilter, JsonFormatter, TextFormatter, bind, log_context

ROOT = Path(__file__).resolve().parents[2]


def record(msg: str = "job dispatched to box") -> logging.LogRecord:
    rec = logging.LogRecord("racon.api", logging.INFO, __file__, 1, msg, None, None)
    ContextFilter().filter(rec)
    return rec


def test_json_lines_carry_request_job_node_and_deployment_ids() -> None:
    with log_context(request_id="req-1", job_id="job-1"):
        bind(deployment_id="dep-1", node_id="node-1")
        line = JsonFormatter().format(record())
    data = json.loads(line)
    assert (
        data["msg"] == "job dispatched to box"
        and data["level"] == "INFO"
        and data["logger"] == "racon.api"
    )
    assert (data["request_id"], data["job_id"], data["deployment_id"], data["node_id"]) == (
        "req-1",
        "job-1",
        "dep-1",
        "node-1",
    )
    assert data["ts"].endswith("Z")


def test_text_lines_are_readable_and_carry_the_same_context() -> None:
    with log_context(job_id="job-2", node_id="node-2"):
        line = TextFormatter().format(record("started"))
    assert "INFO" in line and "racon.api: started" in line
    assert line.endswith("[job_id=job-2 node_id=node-2]")


def test_context_ends_with_its_block_and_explicit_extra_wins() -> None:
    with log_context(job_id="outer"):
        rec = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        rec.__dict__["job_id"] = "explicit"  # what logging's extra= does
        ContextFilter().filter(rec)
        assert rec.__dict__["job_id"] == "explicit"
    after = record()
    assert not hasattr(after, "job_id")
    assert "job_id" not in json.loads(JsonFormatter().format(after))


@pytest.mark.parametrize(("debug", "expected"), [("false", "json"), ("true", "text")])
def test_production_logs_json_and_development_logs_text(debug: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_FORMAT", "DJANGO_SETTINGS_MODULE")}
    env["DEBUG"] = debug
    code = (
        "import os; os.environ['DJANGO_SETTINGS_MODULE']='racon.settings'; import django; django.setup(); "
        "import logging; logging.getLogger('racon.api').warning('hello')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    line = out.stderr.strip().splitlines()[-1]
    if expected == "json":
        assert json.loads(line)["msg"] == "hello"
    else:
        assert line.endswith("WARNING racon.api: hello")
