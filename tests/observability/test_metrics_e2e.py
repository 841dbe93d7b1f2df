"""/metrics scraped from a live controller after real activity: an enrolled node, a chat, a drain."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import timing
from tests.support.observability import LiveRun

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    got = samples(text)
    key = (name, frozenset(labels.items()))
    assert key in got, f"{name}{labels} missing from the scrape"
    return got[key]


def test_a_scrape_without_the_token_is_refused(live_run: LiveRun) -> None:
    assert live_run.unauthorized_status == 401
    assert live_run.wrong_token_status == 401


def test_the_drained_node_is_counted_as_drained(live_run: LiveRun) -> None:
    before, after = live_run.metrics_before_drain, live_run.metrics_after_drain
    assert (
        value(before, "racon_nodes", state="READY") + value(before, "racon_nodes", state="BUSY")
        == 1
    )
    assert value(before, "racon_nodes", state="DRAINED") == 0
    assert value(after, "racon_nodes", state="DRAINED") == 1
    assert value(after, "racon_nodes", state="READY") == 0
    assert (
        sum(
            value(after, "racon_nodes", state=s)
            for s in (
                "UNINITIALIZED",
                "REGISTERING",
                "READY",
                "BUSY",
                "DRAINING",
                "DRAINED",
                "DEGRADED",
                "OFFLINE",
                "ERROR",
            )
        )
        == 1
    )


def test_the_completed_chat_is_counted_with_its_tokens_and_timings(live_run: LiveRun) -> None:
    text, model = live_run.metrics_after_drain, live_run.model
    assert value(text, "racon_jobs", state="COMPLETED", model=model) == 1
    assert value(text, "racon_jobs", state="FAILED", model=model) == 0
    assert value(text, "racon_jobs", state="RUNNING", model=model) == 0
    assert value(text, "racon_jobs_finished_total", state="COMPLETED", model=model) == 1
    assert live_run.completion_tokens > 0
    assert value(text, "racon_tokens_generated_total", model=model) == live_run.completion_tokens
    assert value(text, "racon_ttft_seconds_count", model=model) == 1
    assert value(text, "racon_tokens_per_second_count", model=model) == 1
    assert value(text, "racon_queue_wait_seconds_count", model=model) == 1
    assert value(text, "racon_queue_depth") == 0


def test_credits_minted_and_spent_follow_the_ledger(live_run: LiveRun) -> None:
    text = live_run.metrics_after_drain
    assert value(text, "racon_credits_minted_total", kind="GRANT") >= live_run.starting_grant > 0
    assert live_run.charged > 0
    assert value(text, "racon_credits_spent_total") == live_run.charged


def test_pool_deployments_placements_and_heartbeats_reflect_the_cluster(live_run: LiveRun) -> None:
    text = live_run.metrics_before_drain
    assert value(text, "racon_pool_nodes") == 1
    assert value(text, "racon_pool_cpu_cores") > 0
    assert (
        value(text, "racon_pool_ram_bytes", kind="total")
        >= value(text, "racon_pool_ram_bytes", kind="free")
        > 0
    )
    assert value(text, "racon_deployments", state="READY") == 1
    assert value(text, "racon_placement_decisions_total") >= 1
    assert value(text, "racon_placement_latency_seconds_count") == value(
        text, "racon_placement_decisions_total"
    )
    # A live node is never further behind than the window after which it would be DEGRADED.
    assert value(text, "racon_heartbeat_lag_seconds_gcount") == 1
    assert 0 <= value(text, "racon_node_heartbeat_lag_seconds") < timing.live_heartbeat_age()


def test_the_agent_metrics_port_serves_the_nodes_runtime_figures(live_run: LiveRun) -> None:
    text = live_run.agent_metrics
    assert value(text, "racon_agent_state", state="READY") == 1
    assert value(text, "racon_agent_rpc_worker_up") == 1
    assert value(text, "racon_agent_models_loaded") == 1
    assert value(text, "racon_agent_jobs_finished_total") == 1
    # Its end was recorded from the stream: the job_finished report was not needed.
    assert value(text, "racon_agent_job_reports_skipped_total") == 1
    assert value(text, "racon_agent_completion_tokens_total") == live_run.completion_tokens
    assert value(text, "racon_agent_process_memory_bytes") > 0
    assert value(text, "racon_agent_memory_used_bytes") > 0
