"""Mid-stream failover with real agents and the real SmolLM2 (issue 13, items 1-3).

Two agents, one replica of the model on each. The llama-server of the replica serving a stream
is killed with SIGKILL after ~10 chunks: the same SSE stream goes on from the other replica with
every token once and one final usage, the job has two attempts, a JOB_FAILOVER event, and both
primaries are paid for what they produced. The next request is served (not 502); a queued job of
the killed deployment is re-dispatched; a non-streamed request fails over the same way.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from agent.protocol import job_stream_key
from apps.credits.models import Entry, EntryKind, Receipt
from apps.jobs.models import Deployment, Job, JobAttempt
from apps.nodes.models import Event
from racon.redis import get_redis
from tests.support import timing

from .harness import Controller, StartAgents, chat_ok, consumer_headers, stream_chat, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODEL = "smollm2-failover"
PROMPT = [
    {"role": "user", "content": "Count slowly from one to forty, in words, one number per line."}
]
MAX_TOKENS = 80
GREEDY = {"model": MODEL, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7}


def _replica(controller: Controller, node: str) -> str:
    dep = controller.post(
        "/api/admin/deployments", {"model": MODEL, "nodes": [node], "n_ctx": 512, "n_parallel": 1}
    )
    assert dep.status_code == 202, dep.text
    return str(dep.json()["id"])


def _ready(dep_id: str) -> bool:
    state = Deployment.objects.filter(pk=dep_id).values_list("state", flat=True).first()
    assert state != "FAILED", f"deployment {dep_id} failed"
    return state in ("READY", "DEGRADED")


def _serving(job_id: str) -> Deployment:
    dep = Job.objects.select_related("deployment").get(pk=job_id).deployment
    assert dep is not None
    return dep


def _kill_engine(dep: Deployment) -> int:
    pid = int((dep.load_report or {}).get("pid") or 0)
    assert pid > 0, dep.load_report
    os.kill(pid, signal.SIGKILL)
    return pid


def _ensure_two_replicas(controller: Controller) -> None:
    """One READY replica on each node: a killed one is replaced on its own node (it is pinned)."""
    for node in ("fo-a", "fo-b"):

        def ready_on(n: str = node) -> bool:
            return Deployment.objects.filter(
                model__name=MODEL, primary__name=n, state__in=["READY", "DEGRADED"]
            ).exists()

        try:
            wait_for(ready_on, 60, f"the replacement on {node}")
        except AssertionError:
            _replica(controller, node)
            wait_for(ready_on, 180, f"a READY replica on {node}")


@pytest.fixture
def cluster(controller: Controller, serving_agents: StartAgents) -> dict[str, Any]:
    names = ("fo-a", "fo-b")
    agents, _ = serving_agents("failover", names, MODEL)
    deps = [_replica(controller, n) for n in names]
    for d in deps:
        wait_for(functools.partial(_ready, d), 180, "both replicas READY")
    headers = consumer_headers("failover-consumer")
    # The greedy reference, run alone (CLARIFICATIONS, "Output identity").
    ref = chat_ok(controller, headers, GREEDY)
    return {
        "headers": headers,
        "reference": ref.json()["choices"][0]["message"]["content"],
        "ref_usage": ref.json()["usage"],
        "agents": list(agents.values()),
    }


def _streamed_failover(controller: Controller, cluster: dict[str, Any]) -> None:
    _ensure_two_replicas(controller)
    killed: dict[str, Any] = {}

    def kill_at_ten(out: dict[str, Any]) -> None:
        if out["chunks"] == 10 and not killed:
            dep = _serving(out["job"])
            killed.update(
                dep=str(dep.id),
                node=out["node"],
                pid=_kill_engine(dep),
                at=time.monotonic(),
                chunk=out["chunks"],
            )

    body = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    out = stream_chat(controller, cluster["headers"], body, on_chunk=kill_at_ten)
    assert killed, out
    assert out["done"] and out["error"] is None, out
    assert len(out["usage"]) == 1, out["usage"]  # one final usage
    times = out["times"]
    gap = max(
        b - a for a, b in zip(times[killed["chunk"] - 1 :], times[killed["chunk"] :], strict=False)
    )
    print(f"\nfailover gap (last token of attempt 1 -> first of attempt 2): {gap:.2f}s")
    # The engine's death is seen at once and the next replica is loaded already; the bound is
    # for a busy machine (RACON_TEST_SLOWDOWN scales it), the figure is the print above.
    assert gap <= timing.scaled(50)
    # The text is the greedy reference's: at least its first tokens, every token once.
    ref = cluster["reference"]
    print(f"failover text equals the reference: {out['text'] == ref}")
    assert out["text"][:40] == ref[:40], (out["text"], ref)
    # The view records the job right after [DONE].
    job = wait_for(
        lambda: Job.objects.filter(pk=out["job"], state="COMPLETED").first(),
        30,
        "the job COMPLETED",
    )
    usage = out["usage"][0]
    assert usage["completion_tokens"] == job.completion_tokens
    assert out["chunks"] <= job.completion_tokens <= GREEDY["max_tokens"]
    attempts = list(JobAttempt.objects.filter(job=job).order_by("number"))
    assert [a.number for a in attempts] == [1, 2]
    assert attempts[0].outcome == "PRIMARY_DIED" and attempts[1].outcome == "COMPLETED"
    assert attempts[0].completion_tokens >= 10 and attempts[1].completion_tokens > 0
    assert attempts[0].completion_tokens + attempts[1].completion_tokens == job.completion_tokens
    assert attempts[0].primary_id != attempts[1].primary_id
    failover = Event.objects.filter(kind="JOB_FAILOVER", job_id=job.id)
    assert failover.count() == 1
    data = failover.get().data
    assert (
        data["from_deployment"] == killed["dep"]
        and data["tokens_so_far"] == attempts[0].completion_tokens
    )
    # Credits: both primaries paid, in proportion to what each produced; never more than held.
    settle = wait_for(
        lambda: Entry.objects.filter(kind=EntryKind.SETTLE, job_id=job.id).first(),
        60,
        "the settlement",
    )
    paid = {str(r.node_id): r.credits for r in Receipt.objects.filter(job_id=job.id)}
    first, second = str(attempts[0].primary_id), str(attempts[1].primary_id)
    assert paid.get(first, 0) > 0 and paid.get(second, 0) > 0, paid
    assert settle.data["charged"] <= settle.data["held"]
    w1 = attempts[0].completion_tokens + job.prompt_tokens
    w2 = attempts[1].completion_tokens
    assert abs(paid[first] / (paid[first] + paid[second]) - w1 / (w1 + w2)) < 0.02, (paid, w1, w2)

    # (b) The next request is served, by a live replica (not 502).
    nxt = httpx.post(
        controller.url + "/v1/chat/completions",
        json={**GREEDY, "max_tokens": 8},
        headers=cluster["headers"],
        timeout=120,
    )
    assert nxt.status_code == 200, nxt.text
    assert Deployment.objects.get(pk=killed["dep"]).state in ("FAILED", "STOPPED")


def _non_streamed_failover(controller: Controller, cluster: dict[str, Any]) -> None:
    _ensure_two_replicas(controller)
    result: dict[str, Any] = {}

    def call() -> None:
        result["resp"] = httpx.post(
            controller.url + "/v1/chat/completions",
            json=GREEDY,
            headers=cluster["headers"],
            timeout=240,
        )

    t = threading.Thread(target=call)
    before = set(Job.objects.values_list("id", flat=True))
    t.start()
    job = wait_for(
        lambda: (
            Job.objects.exclude(id__in=before)
            .filter(
                model__name=MODEL,
                max_tokens=MAX_TOKENS,  # not a check of the replacement replica's
                state__in=["DISPATCHED", "RUNNING"],
                completion_tokens=0,
            )
            .select_related("deployment")
            .first()
        ),
        60,
        "the job dispatched",
        interval=0.02,
    )
    # Tokens in, read from the primary's stream itself: a fixed sleep after RUNNING (polled every
    # 0.25 s) could kill an engine that had already finished the job (a fresh clone's CI: 0
    # attempts instead of 2). Nor is the text compared with the reference: the same greedy
    # request gives another text when the replica has its prompt cached (llama.cpp evaluates it
    # otherwise; seen here: "One number per line: 123456." and EOS at 14 tokens), so the check
    # is that the answer goes on from what the killed attempt had streamed.
    stream = job_stream_key(str(job.id), str(job.deployment.primary_id))
    r = get_redis()
    before_kill = wait_for(
        lambda: (lambda got: got if len(got) >= 2 else None)(r.xrange(stream)),
        60,
        "two entries in",
        interval=0.01,
    )
    _kill_engine(job.deployment)
    streamed = "".join(f.get("text", "") for _, f in before_kill if f.get("type") == "chunk")
    t.join(240)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    assert streamed and content.startswith(streamed), (streamed, content)
    assert JobAttempt.objects.filter(job_id=job.id).count() == 2
    wait_for(
        lambda: Job.objects.filter(pk=job.id, state="COMPLETED").exists(), 30, "the job COMPLETED"
    )


def _queued_jobs_redispatched(controller: Controller, cluster: dict[str, Any]) -> None:
    _ensure_two_replicas(controller)
    # One slot per replica: four streams at once leave two waiting.
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            got = stream_chat(
                controller, cluster["headers"], {**GREEDY, "stream": True, "max_tokens": 40}
            )
        except Exception as exc:  # reported by the assertions below
            got = {"error": repr(exc), "done": False}
        with lock:
            results.append(got)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(
        lambda: Job.objects.filter(model__name=MODEL, state="QUEUED").exists(), 60, "a queued job"
    )
    victim = Deployment.objects.filter(model__name=MODEL, state__in=["READY", "DEGRADED"]).first()
    assert victim is not None
    _kill_engine(victim)
    for t in threads:
        t.join(300)
    assert len(results) == 4
    assert all(r["done"] and r["error"] is None for r in results), results
    # No job left open (each view records its job right after [DONE]).
    wait_for(
        lambda: (
            not Job.objects.filter(
                model__name=MODEL, state__in=["QUEUED", "DISPATCHED", "RUNNING"]
            ).exists()
        ),
        30,
        "every job terminal",
    )
    assert not Job.objects.filter(model__name=MODEL, state="FAILED").exists()


def test_failover_streamed_next_request_non_streamed_and_queued(
    controller: Controller, cluster: dict[str, Any]
) -> None:
    """One test: the database is flushed after each test of this module (transaction=True)."""
    _streamed_failover(controller, cluster)  # (a) and (b)
    _non_streamed_failover(controller, cluster)  # (d)
    _queued_jobs_redispatched(controller, cluster)  # (c)
