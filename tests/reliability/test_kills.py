"""kill -9 under load: 8 concurrent streaming chats on two replicas, one process killed per test.

What each prints (and the summary table gathers): requests sent and lost, jobs left open, ledger
violations (credits_check), holds still open, and the time from the kill until a retry succeeds.
Required whatever the failover does (CLARIFICATIONS, Recovery): no stuck job, a ledger that
verifies, every hold released, a retry that succeeds. Requests lost: 0 while a replica is
available, asserted in every scenario (the requests a killed daphne held count as lost by design).

Redis comes last: after its restart the surviving daphne process still holds dead pooled
connections for a while (a request then gets 500), which would count against the next scenario.

Run alone: pytest tests/reliability -s -p no:cacheprovider
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest

from tests.launcher.harness import is_redis, wait_for

from .harness import (
    ACTIVE,
    GHOST_NOTE,
    READY_TIMEOUT,
    Cluster,
    Outcome,
    Result,
    client_ports,
    cmdline,
    run_scenario,
    wait_gone,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def sigkill(p: psutil.Process, what: str) -> str:
    os.kill(p.pid, signal.SIGKILL)
    return f"{what} (pid {p.pid})"


def launcher_child(cluster: Cluster, program: str, *args: str) -> psutil.Process:
    """The launcher's child running `program` (a path ending so) with all of `args`."""

    def match(cl: list[str]) -> bool:
        return any(part.endswith(program) for part in cl[:2]) and all(a in cl for a in args)

    p = cluster.launcher.child(match)
    assert p is not None, f"no {program} {' '.join(args)} child of the launcher"
    return p


def record(results: list[Result], r: Result, cluster: Cluster | None = None) -> Result:
    results.append(r)
    print(f"\n{r.line()}")
    log = cluster.launcher.log() if cluster is not None and r.failed else ""
    for o in r.failed:
        last = (o.last_chunk - o.started) if o.last_chunk else 0.0
        print(
            f"  {o.kind}: client port {o.client_port}, job {o.job[:8] or '?'}, {o.chunks} chunks,"
            f" {o.ended - o.started:.1f} s, last chunk at {last:.1f} s, longest gap"
            f" {o.max_gap:.1f} s: {' '.join(o.detail.split())[:160]}"
        )
        # What the controller and the agents logged of this job: failover, stalls, errors.
        if o.job:
            for line in [ln for ln in log.splitlines() if o.job[:8] in ln][:12]:
                print(f"    | {line[:240]}")
    return r


def assert_settled(r: Result) -> None:
    """What must hold after any kill."""
    assert r.recover_s is not None, f"no retry succeeded within the deadline: {r.line()}"
    assert r.stuck_jobs == 0, f"jobs left open after the settle wait: {r.line()}"
    assert r.holds_open == 0, f"holds not released: {r.line()}"
    assert r.violations == 0, f"ledger violations: {r.line()}"
    assert r.replicas_s is not None, f"two READY replicas did not come back: {r.line()}"


def split_deployments(cluster: Cluster) -> list[dict[str, Any]]:
    """Active deployments whose plan has an RPC worker (a model split across the two agents)."""
    return [
        d for d in cluster.deployments() if d["state"] in ACTIVE and d["plan"].get("rpc_endpoints")
    ]


def test_an_rpc_worker(cluster: Cluster, results: list[Result]) -> None:
    # SmolLM2 fits one node, so the cluster's two replicas are whole models. A third, spread over
    # both agents, gives the scenario a split whose RPC worker can die under load; its jobs fail
    # over to the whole replicas. It is stopped at the end, with any replacement of it, so the
    # later scenarios see the two replicas alone.
    # Placement takes only nodes that can take new work: both must be READY (not BUSY from the
    # warm-up's jobs) when the split is asked for, or the plan lands on one of them.
    def both_ready() -> list[str] | None:
        found = sorted(n["name"] for n in cluster.ready_nodes())
        return found if len(found) >= 2 else None

    names = wait_for(both_ready, 60, "both agents READY", interval=0.5)
    resp = cluster.post(
        "/api/admin/deployments",
        {"model": cluster.model, "nodes": names, "spread": True, "allow_same_node": True},
    )
    assert resp.status_code == 202, resp.text
    made = resp.json()["id"]

    def split_ready() -> dict[str, Any] | None:
        d = next((d for d in cluster.deployments() if d["id"] == made), None)
        assert d is not None and d["state"] not in ("FAILED", "STOPPED"), d
        if d["state"] != "READY":
            return None
        assert d["plan"].get("rpc_endpoints"), f"the spread deployment is not split: {d['plan']}"
        return d

    try:
        dep = wait_for(split_ready, READY_TIMEOUT, "the split deployment to be READY", interval=1.0)
        workers = {
            dev["node_id"]
            for dev in dep["plan"]["devices"]
            if dev.get("endpoint") and dev["node_id"] != dep["primary"]
        }
        assert workers, dep["plan"]
        by_id = {n["id"]: n["name"] for n in cluster.ready_nodes()}
        agents = cluster.agents()

        def kill() -> str:
            for node_id in workers:
                agent = agents.get(by_id.get(node_id, ""))
                if agent is None:
                    continue
                for p in agent.children(recursive=True):
                    # The worker starts as agent.runtime.rpc_worker_main and execs the build's
                    # ggml-rpc-server (same pid): either command line is the RPC worker.
                    line = cmdline(p)
                    if "agent.runtime.rpc_worker_main" in line or (
                        line and line[0].endswith("ggml-rpc-server")
                    ):
                        return sigkill(p, f"the RPC worker of {by_id[node_id]}")
            raise AssertionError(f"no RPC worker process for the plan's workers {workers}")

        r = record(results, cluster=cluster, r=run_scenario(cluster, "rpc worker", kill))
    finally:
        for d in split_deployments(cluster):
            cluster.post(f"/api/admin/deployments/{d['id']}/stop", None)
        wait_for(
            lambda: not split_deployments(cluster),
            120,
            "the split deployments to stop",
            interval=1.0,
        )
    assert_settled(r)
    # The split's streams fail over to a whole replica (apps/jobs/failover.py).
    assert r.lost == 0, r.line()


def test_a_primary(cluster: Cluster, results: list[Result]) -> None:
    target = cluster.serving()[0]

    def kill() -> str:
        p = cluster.primary_process(target["id"])
        assert p is not None, f"no llama-server for deployment {target['id']}"
        return sigkill(p, f"llama-server of {target['primary_name']}")

    r = record(results, cluster=cluster, r=run_scenario(cluster, "primary", kill))
    assert_settled(r)
    assert r.lost == 0, r.line()  # mid-stream failover to the other replica


def test_an_agent(cluster: Cluster, results: list[Result]) -> None:
    target = cluster.serving()[0]
    agent = cluster.agents()[target["primary_name"]]

    def kill() -> str:
        return sigkill(agent, f"node-agent {target['primary_name']}")

    r = record(results, cluster=cluster, r=run_scenario(cluster, "agent", kill))
    wait_gone(agent)
    assert_settled(r)
    assert r.lost == 0, r.line()  # the dead agent's streams fail over to the other replica
    # The restarted agent holds nothing: its AGENT_STARTED report has the controller fail and
    # replace the READY deployment it lost, so the test never has to stop a ghost itself.
    assert GHOST_NOTE not in r.note, r.line()


def test_the_celery_worker(cluster: Cluster, results: list[Result]) -> None:
    worker = launcher_child(cluster, "celery", "worker", "racon@%h")

    def kill() -> str:
        return sigkill(worker, "celery worker (the default queue's)")

    r = record(results, cluster=cluster, r=run_scenario(cluster, "celery worker", kill))
    assert_settled(r)
    # Streams go daphne - Redis - agent: the worker only places, sweeps and settles.
    assert r.lost == 0, r.line()


def test_a_daphne_process(cluster: Cluster, results: list[Result]) -> None:
    daphne = launcher_child(cluster, "daphne")

    held: set[int] = set()
    killed_at: list[float] = []

    def kill() -> str:
        held.update(client_ports(daphne, cluster.launcher.port))
        killed_at.append(time.monotonic())
        return f"{sigkill(daphne, 'daphne')}, holding {len(held)} client connections"

    def dropped(o: Outcome) -> bool:
        # A connection the killed process held dies with it, by design, whatever the client saw;
        # any other failure is a loss (a later request on a reused port number is not exempt).
        return o.client_port in held and o.started <= killed_at[0]

    r = record(results, cluster=cluster, r=run_scenario(cluster, "daphne", kill, by_design=dropped))
    assert_settled(r)
    # The other daphne process serves everyone else. The client timeouts once seen here (4 in a
    # CI run, 5 in a local run) were on the surviving process's connections: both replicas' engines
    # ran a thread per core on the same 2 cores and stalled each other at ggml's barriers, about
    # half a token per second for a minute after any hiccup. The launcher now shares the cores
    # among its local agents (racon/launcher.py local_agent_threads).
    assert r.lost == 0, r.line()


def test_redis(cluster: Cluster, results: list[Result]) -> None:
    server = cluster.launcher.child(is_redis)
    assert server is not None

    def kill() -> str:
        return sigkill(server, "embedded redis-server")

    r = record(results, cluster=cluster, r=run_scenario(cluster, "redis", kill))
    assert_settled(r)
    # The clients retry on new connections, stream followers wait out the restart (racon/redis.py,
    # apps/jobs/streams.py) and the agent's stream writer retries its writes through it, in order
    # and without duplicates (agent/runtime/stream.py). The 3 of 16 once lost here ("still
    # streaming after 60s") were the engines' shared-core stall above, not the restart.
    assert r.lost == 0, r.line()
