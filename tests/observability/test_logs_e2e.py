"""One request's job id appears in the controller's structured logs and in the agent's log."""

from __future__ import annotations

import json

import pytest

from tests.support.observability import LiveRun

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def json_lines(text: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_the_same_job_id_is_in_the_controller_log_and_the_agent_log(live_run: LiveRun) -> None:
    controller = [
        r for r in json_lines(live_run.controller_log) if r.get("job_id") == live_run.job_id
    ]
    assert controller, "no controller log line carries the job id as a field"
    assert live_run.job_id in live_run.agent_log, "the agent's log never names the job"


def test_controller_lines_of_the_request_carry_request_job_and_deployment_ids(
    live_run: LiveRun,
) -> None:
    lines = [
        r for r in json_lines(live_run.controller_log) if r.get("request_id") == live_run.request_id
    ]
    dispatched = [r for r in lines if str(r.get("msg", "")).startswith("job dispatched to")]
    assert dispatched, "the dispatch line of the request is missing"
    assert dispatched[0]["job_id"] == live_run.job_id
    assert dispatched[0]["deployment_id"] == live_run.deployment_id
    for r in lines:
        assert {"ts", "level", "logger", "msg"} <= set(r)


def test_node_events_in_the_controller_log_carry_the_node_id(live_run: LiveRun) -> None:
    node_lines = [
        r for r in json_lines(live_run.controller_log) if r.get("node_id") == live_run.node_id
    ]
    kinds = {str(r["msg"]).split(" ", 1)[0] for r in node_lines}
    assert {"NODE_ENROLLED", "NODE_READY", "NODE_DRAINED"} <= kinds, kinds
