"""`node-agent pause` with real agents and the real SmolLM2 (issue 18): two agents, one replica of
the model on each, a stream running on one of them when its owner pauses it.

- No new job reaches the paused node once the controller has it DRAINING: every job dispatched
  after that transition went to the other node (asserted by order; the time from the pause to
  DRAINING is printed as a figure).
- ``--handoff failover``: the running stream goes on from the other replica (the planned handoff,
  code ``node_paused``), every token once, one final usage, two attempts.
- ``--handoff finish``: the running stream finishes on the paused node, one attempt, and the node
  turns DRAINED once it has.

It holds on a busy machine (``make test-load``): each agent lends one thread, as the cluster hosts
do. Two llama-servers of two threads each on this machine's two cores stall one another, and with
one core taken by another process a stream crawled (one run went past pytest-timeout's 600 s inside
a stream). Its waits are bounded by tests/support/timing.py, scaled.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from apps.jobs.models import Deployment, Job, JobAttempt
from apps.nodes.models import Event, Node
from tests.support.timing import scaled

from .harness import (
    BIN,
    ROOT,
    AgentProc,
    Controller,
    StartAgents,
    consumer_headers,
    stream_chat,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-pause"
NODES = ("pz-a", "pz-b")
# The prompt of tests/e2e/test_failover.py: SmolLM2 counts for well over a hundred tokens. No
# token cap short of its end: with 100 tokens on a quiet machine the stream once ended 0.1 s
# before the node turned DRAINING (about 0.5 s after the pause was asked for).
PROMPT = [
    {"role": "user", "content": "Count slowly from one to forty, in words, one number per line."}
]
LONG = {"model": MODEL, "messages": PROMPT, "max_tokens": 1000, "temperature": 0, "seed": 7}
# The finish handoff streams another conversation: the same one again is routed to the slot that
# holds its prefix (the KV coordinator), and in one fresh-clone CI run it then ended after 14
# tokens, before the pause landed. This one ran to the 1,000-token cap alone, twice in a row on
# one slot and beside LONG on a 2-slot llama-server, and in the e2e runs.
STORY = [
    {
        "role": "user",
        "content": "Write a long story about a dragon who learns to cook. Use at least five paragraphs.",
    }
]


def _replica_on(controller: Controller, node: str) -> None:
    """One READY replica of the model on ``node`` (placed again after a pause stopped it)."""

    def ready() -> bool:
        return Deployment.objects.filter(
            model__name=MODEL, primary__name=node, state__in=["READY", "DEGRADED"]
        ).exists()

    if ready():
        return
    dep = controller.post(
        "/api/admin/deployments", {"model": MODEL, "nodes": [node], "n_ctx": 2048, "n_parallel": 2}
    )
    assert dep.status_code == 202, dep.text
    wait_for(ready, scaled(180), f"a READY replica on {node}")


def _node_state(name: str) -> str:
    return str(Node.objects.get(name=name).state)


def _lending(agent: AgentProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "node-agent"), *args, "--state-dir", str(agent.state_dir), "--timeout", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _draining_at(node: Node, after: datetime) -> datetime:
    ev = wait_for(
        lambda: (
            # NODE_DRAIN_REQUESTED: the pause's drain (apps/nodes/services.py: node_drain)
            Event.objects.filter(node=node, new_state="DRAINING", created_at__gte=after)
            .order_by("created_at")
            .first()
        ),
        scaled(30),
        f"{node.name} DRAINING",
    )
    return ev.created_at


def _served_elsewhere_after(node: Node, since: datetime) -> list[str]:
    """Jobs dispatched after ``since``: those that went to ``node`` (none expected)."""
    first = Job.objects.filter(dispatched_at__gt=since, deployment__primary=node)
    later = JobAttempt.objects.filter(started_at__gt=since, primary=node)
    return [str(j) for j in first.values_list("id", flat=True)] + [
        str(a) for a in later.values_list("job_id", flat=True)
    ]


@pytest.fixture
def cluster(
    controller: Controller,
    serving_agents: StartAgents,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    # Each agent lends one thread (the lending policy's thread cap, read from RACON_POLICY by the
    # agents started below and by the pause/resume CLI): the plan's n_threads is then 1, so the
    # two replicas do not fight over the two cores (see the module docstring).
    policy = tmp_path / "lend-one-thread.toml"
    policy.write_text("[caps]\nthreads = 1\n")
    monkeypatch.setenv("RACON_POLICY", str(policy))
    agents, _ = serving_agents("pause", NODES, MODEL)
    for n in NODES:
        _replica_on(controller, n)
    return {"headers": consumer_headers("pause-consumer"), "agents": agents}


def _pause_mid_stream(
    controller: Controller,
    cluster: dict[str, Any],
    handoff: str,
    *,
    at_chunk: int = 8,
    messages: list[dict[str, str]] = PROMPT,
) -> dict[str, Any]:
    """Stream LONG (or ``messages``); after ``at_chunk`` chunks pause the node serving it; then two more requests.
    Returns the stream, the paused node, the times and the later requests' answers."""
    for n in NODES:
        _replica_on(controller, n)
    agents: dict[str, AgentProc] = cluster["agents"]
    box: dict[str, Any] = {"later": []}
    paused = threading.Event()

    def later_request() -> None:
        resp = httpx.post(
            controller.url + "/v1/chat/completions",
            json={**LONG, "max_tokens": 8},
            headers=cluster["headers"],
            timeout=240,
        )
        box["later"].append(resp)

    def pause() -> None:
        box["asked"] = timezone.now()
        t0 = time.monotonic()
        box["cli"] = _lending(agents[box["node"]], "pause", "--handoff", handoff)
        box["cli_s"] = time.monotonic() - t0
        box["confirmed"] = timezone.now()
        paused.set()

    worker = threading.Thread(target=pause)

    def on_chunk(out: dict[str, Any]) -> None:
        if out["chunks"] == at_chunk and "node" not in box:
            box["node"] = out["node"]
            worker.start()

    body = {**LONG, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    box["stream"] = stream_chat(controller, cluster["headers"], body, on_chunk=on_chunk)
    print(
        f"\nstream ({handoff}): {box['stream']['chunks']} chunks in {time.monotonic() - t0:.1f}s "
        f"(paused at chunk {at_chunk})"
    )
    assert paused.wait(scaled(60)), box
    worker.join(scaled(300))
    # Later requests, once the stream is over (each replica then has its slots free): the
    # paused node takes none of them.
    for _ in range(2):
        later_request()
    cli = box["cli"]
    assert cli.returncode == 0, (cli.stdout, cli.stderr)
    assert f"handoff: {handoff}" in cli.stdout, cli.stdout
    node = Node.objects.get(name=box["node"])
    box["paused_node"] = node
    box["other"] = next(n for n in NODES if n != node.name)
    box["draining_at"] = _draining_at(node, box["asked"])
    lag = (box["draining_at"] - box["asked"]).total_seconds()
    print(
        f"\npause ({handoff}): CLI confirmed in {box['cli_s']:.2f}s; the controller had "
        f"{node.name} DRAINING {lag:.2f}s after the pause was asked for"
    )
    assert lag < scaled(30)  # a generous bound; the figure above is what to read
    return box


def _no_new_job_after_draining(box: dict[str, Any]) -> None:
    node, since = box["paused_node"], box["draining_at"]
    assert _served_elsewhere_after(node, since) == []
    assert len(box["later"]) == 2
    for resp in box["later"]:
        assert resp.status_code == 200, resp.text
        job = Job.objects.select_related("deployment__primary").get(
            pk=resp.headers["x-racon-job-id"]
        )
        assert job.dispatched_at is not None and job.dispatched_at > since
        assert resp.headers["x-racon-nodes"] == box["other"], (resp.headers, since)


def _resume(cluster: dict[str, Any], box: dict[str, Any]) -> None:
    agent = cluster["agents"][box["paused_node"].name]
    out = _lending(agent, "resume")
    assert out.returncode == 0, (out.stdout, out.stderr)
    wait_for(
        lambda: _node_state(agent.name) == "READY", scaled(60), f"{agent.name} READY after resume"
    )


def _failover_handoff(controller: Controller, cluster: dict[str, Any]) -> None:
    box = _pause_mid_stream(controller, cluster, "failover")
    out = box["stream"]
    assert out["done"] and out["error"] is None, out
    assert len(out["usage"]) == 1, out["usage"]
    job = wait_for(
        lambda: Job.objects.filter(pk=out["job"], state="COMPLETED").first(),
        scaled(30),
        "the streamed job COMPLETED",
    )
    attempts = list(JobAttempt.objects.filter(job=job).order_by("number"))
    assert [a.number for a in attempts] == [1, 2], attempts
    assert attempts[0].outcome == "NODE_PAUSED" and attempts[1].outcome == "COMPLETED"
    assert attempts[0].primary_id == box["paused_node"].id
    assert attempts[1].primary.name == box["other"]
    assert attempts[0].completion_tokens >= 8 and attempts[1].completion_tokens > 0
    assert attempts[0].completion_tokens + attempts[1].completion_tokens == job.completion_tokens
    assert out["usage"][0]["completion_tokens"] == job.completion_tokens
    moved = Event.objects.get(kind="JOB_FAILOVER", job_id=job.id)
    assert moved.data["cause"] == "node_paused", moved.data
    # The handoff happened after the pause was asked for, at the tokens produced so far.
    assert attempts[1].started_at >= box["asked"]
    print(
        f"failover handoff: {attempts[0].completion_tokens} tokens on {box['paused_node'].name}, "
        f"{attempts[1].completion_tokens} on {box['other']}"
    )
    _no_new_job_after_draining(box)
    _resume(cluster, box)


def _finish_handoff(controller: Controller, cluster: dict[str, Any]) -> None:
    # Paused at the first chunk: the agent's stream writer batches tokens into chunks, so on a
    # quiet machine the 8th chunk can come so late that the stream ends before the pause lands.
    box = _pause_mid_stream(controller, cluster, "finish", at_chunk=1, messages=STORY)
    out = box["stream"]
    assert out["done"] and out["error"] is None, out
    job = wait_for(
        lambda: Job.objects.filter(pk=out["job"], state="COMPLETED").first(),
        scaled(30),
        "the streamed job COMPLETED",
    )
    # It finished where it ran: one attempt, no failover, on the paused node.
    assert not JobAttempt.objects.filter(job=job, number__gt=1).exists()
    assert not Event.objects.filter(kind="JOB_FAILOVER", job_id=job.id).exists()
    assert job.deployment is not None and job.deployment.primary_id == box["paused_node"].id
    assert out["node"] == box["paused_node"].name
    # Still running when the agent had applied the pause (the CLI returns once it has): the
    # job the pause found was left to finish, not handed off.
    assert job.finished_at is not None and job.finished_at > box["confirmed"], (
        job.finished_at,
        box["confirmed"],
        job.completion_tokens,
        out["chunks"],
        out["text"][:200],
    )
    _no_new_job_after_draining(box)
    # Drained once its last job ended.
    wait_for(
        lambda: _node_state(box["paused_node"].name) == "DRAINED",
        scaled(120),
        f"{box['paused_node'].name} DRAINED",
    )
    lending = Node.objects.get(pk=box["paused_node"].pk).lending
    assert lending["paused"]["handoff"] == "finish", lending
    _resume(cluster, box)


def test_pause_stops_new_jobs_and_hands_running_ones_off_as_the_owner_chose(
    controller: Controller, cluster: dict[str, Any]
) -> None:
    """One test: the database is flushed after each test of this module (transaction=True)."""
    _failover_handoff(controller, cluster)
    _finish_handoff(controller, cluster)
    print(json.dumps({"nodes": {n: _node_state(n) for n in NODES}}))
