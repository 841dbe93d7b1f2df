"""The deployment registry (agent/registry.py) and run_job's defaults (agent/commands.py)."""

from __future__ import annotations

from typing import cast

import pytest

from agent.commands import validate_job
from agent.protocol import SAMPLING_DEFAULTS, JobFinishedPayload, LoadPrimaryPayload, RunJobPayload
from agent.registry import DeploymentRegistry, DeploymentState
from agent.runtime import PrimaryHandle
from agent.state import CommandError


def plan(dep: str = "dep-1") -> LoadPrimaryPayload:
    return cast(LoadPrimaryPayload, {"deployment_id": dep, "model_name": "tiny", "sha256": "ab"})


def job(job_id: str, dep: str = "dep-1") -> RunJobPayload:
    return validate_job(
        {"job_id": job_id, "deployment_id": dep, "prompt": "x", "kind": "completion"}
    )


def test_a_job_for_a_loading_deployment_waits_and_is_handed_over_on_load() -> None:
    reg = DeploymentRegistry()
    assert reg.register(plan()) is None
    assert reg.telemetry() == {"primaries": [], "loading": ["dep-1"], "jobs": []}
    dep, queued = reg.add_job(job("j1"))
    assert dep is not None and queued
    primary = cast(PrimaryHandle, object())
    assert reg.mark_loaded("dep-1", primary, {"n_ctx": 512}) == [job("j1")]
    assert reg.get("dep-1").state == DeploymentState.LOADED
    assert reg.telemetry() == {"primaries": ["dep-1"], "loading": [], "jobs": ["j1"]}
    assert reg.models_loaded() == [{"deployment_id": "dep-1", "model": "tiny"}]


def test_registering_a_deployment_twice_returns_the_first() -> None:
    reg = DeploymentRegistry()
    reg.register(plan())
    existing = reg.register(plan())
    assert existing is not None and existing.state == DeploymentState.LOADING


def test_a_deployment_removed_while_loading_hands_no_jobs_over() -> None:
    reg = DeploymentRegistry()
    reg.register(plan())
    reg.pop("dep-1")
    assert reg.mark_loaded("dep-1", cast(PrimaryHandle, object()), {}) is None


def test_withdrawing_a_waiting_job_removes_it_from_the_pending_list() -> None:
    reg = DeploymentRegistry()
    reg.register(plan())
    reg.add_job(job("j1"))
    dep, waiting = reg.withdraw_job("j1")
    assert waiting and dep is not None and dep.pending == []
    assert reg.withdraw_job("j1")[1] is False


def test_a_finished_job_updates_the_counters_and_the_last_job() -> None:
    reg = DeploymentRegistry()
    reg.register(plan())
    reg.add_job(job("j1"))
    reg.job_finished(
        JobFinishedPayload(job_id="j1", status="completed", prompt_tokens=3, completion_tokens=7)
    )
    assert reg.running_jobs() == []
    assert reg.counters["jobs_finished_total"] == 1
    assert reg.counters["completion_tokens_total"] == 7
    assert reg.last_job()["status"] == "completed"


def test_run_job_sampling_defaults_are_openais() -> None:
    filled = validate_job(
        {"deployment_id": "d", "messages": [{"role": "user", "content": "hi"}], "top_p": None}
    )
    assert SAMPLING_DEFAULTS == {
        "temperature": 1.0,
        "top_p": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert {k: dict(filled)[k] for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    assert filled["max_tokens"] == 256 and filled["stop"] == []


def test_run_job_refuses_a_sampling_field_that_is_not_a_number() -> None:
    with pytest.raises(CommandError, match="'temperature' must be a number"):
        validate_job(
            {"deployment_id": "d", "kind": "completion", "prompt": "x", "temperature": "hot"}
        )
