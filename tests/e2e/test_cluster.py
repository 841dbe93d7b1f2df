"""Three real agents on loopback, SmolLM2 spread over them with ggml-rpc, the official OpenAI SDK.

One cluster serves the whole scenario (starting agents and loading the model is the slow part):
a spread deployment with layers on both RPC devices, output equal to a single-process local run at
temperature 0, streamed and async chats, every error mapped to the SDK's exception, a client that
disconnects mid-stream, credits split across three owners with verifiable receipts, and finally an
RPC worker killed mid-generation.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from httpx_sse import connect_sse

from agent.runtime.ggml import load_llama_cpp_backends

from .harness import (
    AgentProc,
    Controller,
    make_account_with_key,
    start_agent,
    stop_agent,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PROMPT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
N_CTX = 512
MAX_TOKENS = 24


def direct_local_run(model_path: Path, times: int = 3) -> list[str]:
    """The same prompt through llama-cpp-python in one process (no RPC), temperature 0.

    Asked `times` times in a row on one Llama, as the primary is: llama-cpp-python reuses the
    cached prompt prefix on a repeat, which changes the batch shape of the last prompt token and
    so, at a near-tie, the greedy choice. Comparing call for call keeps the check exact.
    """
    from llama_cpp import Llama

    load_llama_cpp_backends()  # a GPU build's (GGML_BACKEND_DL) backends are modules in its lib/
    # One thread: with two, on a machine where another process holds a core (make test-load),
    # every step waited on the descheduled thread and this run did not end in 9 minutes. The
    # greedy output does not depend on the thread count (each output row is one thread's work).
    llm = Llama(
        model_path=str(model_path), n_ctx=N_CTX, n_threads=1, flash_attn=True, verbose=False
    )  # the primary runs -fa auto
    texts = [
        str(
            llm.create_chat_completion(messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS)[
                "choices"
            ][0]["message"]["content"]
        )
        for _ in range(times)
    ]
    del llm
    return texts


def rpc_worker_pid(agent: AgentProc) -> int:
    found = re.findall(r"RPC worker listening on \S+ \(pid (\d+)\)", agent.log())
    assert found, agent.log()[-2000:]
    return int(found[-1])


def test_spread_deployment_over_three_agents_serves_the_openai_sdk(
    controller: Controller, model_path: Path, tmp_path: Path
) -> None:
    owners = {}
    agents: list[AgentProc] = []
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    os.link(
        model_path, models_dir / model_path.name
    ) if model_path.stat().st_dev == models_dir.stat().st_dev else __import__("shutil").copy(
        model_path, models_dir / model_path.name
    )
    try:
        for name in ("alpha", "beta", "gamma"):
            acct_id, _ = make_account_with_key(f"owner-{name}")
            owners[name] = acct_id
            tok = controller.post("/api/admin/tokens", {"label": name, "account": acct_id})
            assert tok.status_code == 201, tok.text
            agents.append(
                start_agent(controller, tok.json()["token"], name, tmp_path, models_dir=models_dir)
            )
        wait_for(
            lambda: len(controller.get("/api/admin/nodes?state=READY").json()) == 3,
            90,
            "three READY nodes",
        )
        assert (
            controller.post(
                "/api/admin/models", {"path": str(model_path), "name": "smollm2"}
            ).status_code
            == 201
        )

        # Preview first: nothing loads, the plan names all three nodes.
        preview = controller.post(
            "/api/admin/deployments/preview",
            {
                "model": "smollm2",
                "nodes": ["alpha", "beta", "gamma"],
                "spread": True,
                "n_ctx": N_CTX,
            },
        )
        assert preview.status_code == 200, preview.text
        plan = preview.json()
        assert {d["node_name"] for d in plan["devices"] if d["n_layers"] > 0} == {
            "alpha",
            "beta",
            "gamma",
        }
        assert sum(d["n_layers"] for d in plan["devices"]) == plan["n_layer"]
        assert plan["predicted_tokens_per_s"] > 0 and plan["explanation"]
        impossible = controller.post(
            "/api/admin/deployments/preview", {"model": "smollm2", "n_ctx": 1_000_000}
        )
        assert impossible.status_code == 422 and impossible.json()["error"]["message"]
        assert (
            controller.post("/api/admin/deployments/preview", {"model": "nope"}).status_code == 404
        )
        assert (
            controller.post(
                "/api/admin/deployments/preview", {"model": "smollm2", "nodes": ["ghost"]}
            ).status_code
            == 404
        )

        dep = controller.post(
            "/api/admin/deployments",
            {
                "model": "smollm2",
                "nodes": ["alpha", "beta", "gamma"],
                "spread": True,
                "n_ctx": N_CTX,
            },
        )
        assert dep.status_code == 202, dep.text
        dep_id = dep.json()["id"]

        def ready() -> Any:
            d = controller.get(f"/api/admin/deployments/{dep_id}").json()
            assert d["state"] not in ("FAILED", "STOPPED"), d
            return d if d["state"] == "READY" else None

        detail = wait_for(ready, 180, "the spread deployment to be READY")
        devices = {a["device"]: a.get("n_layers", 0) for a in detail["load_report"]["assignment"]}
        assert devices.get("RPC0", 0) > 0 and devices.get("RPC1", 0) > 0, detail["load_report"]
        kinds = [e["kind"] for e in detail["events"]]
        assert (
            "RPC_WORKER_CONFIRMED" in kinds
            and "PRIMARY_LOADED" in kinds
            and "DEPLOYMENT_READY" in kinds
        )

        expected_runs = direct_local_run(model_path)
        expected = expected_runs[0]
        consumer_id, consumer_key = make_account_with_key("consumer")
        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=consumer_key, max_retries=0)

        # Non-streamed: identical to the single-process run at temperature 0.
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS
        )
        resp = raw.parse()
        assert resp.choices[0].message.content == expected
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert (
            resp.usage.completion_tokens > 0
            and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        )
        job_id = raw.headers["x-racon-job-id"]
        assert set(raw.headers["x-racon-nodes"].split(",")) == {"alpha", "beta", "gamma"}
        job = controller.get(f"/api/admin/jobs/{job_id}").json()
        assert job["state"] == "COMPLETED"
        assert [e["kind"] for e in job["events"]][:1] == ["JOB_DISPATCHED"] and "JOB_COMPLETED" in [
            e["kind"] for e in job["events"]
        ]
        assert {d["node"] for d in job["placement"]["devices"]} == {"alpha", "beta", "gamma"}
        assert job["stream_chunks"] > 0

        # Streamed, with usage in the last chunk.
        chunks = list(
            client.chat.completions.create(
                model="smollm2",
                messages=PROMPT,
                temperature=0,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected_runs[1]
        assert (
            chunks[-1].usage is not None
            and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
        )
        assert [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]

        # The async client.
        async def run_async() -> str:
            aclient = openai.AsyncOpenAI(
                base_url=controller.url + "/v1", api_key=consumer_key, max_retries=0
            )
            r = await aclient.chat.completions.create(
                model="smollm2", messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS
            )
            await aclient.close()
            return r.choices[0].message.content or ""

        assert asyncio.run(run_async()) == expected_runs[2]

        # Legacy completions.
        comp = client.completions.create(
            model="smollm2", prompt="The sky is", max_tokens=5, temperature=0
        )
        assert comp.object == "text_completion" and comp.choices[0].text

        # Each error, as the SDK's own exception class.
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=controller.url + "/v1", api_key="wrong", max_retries=0
            ).chat.completions.create(model="smollm2", messages=PROMPT)
        with pytest.raises(openai.NotFoundError) as nf:
            client.chat.completions.create(model="no-such-model", messages=PROMPT)
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as br:
            client.chat.completions.create(model="smollm2", messages=[])
        assert br.value.param == "messages"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="smollm2", messages=PROMPT, n=2)
        with pytest.raises(openai.BadRequestError) as cl:
            client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "word " * 2000}],
                max_tokens=8,
            )
        assert cl.value.code == "context_length_exceeded"
        _, broke_key = make_account_with_key("broke", grant=0)
        with pytest.raises(openai.RateLimitError) as rl:
            openai.OpenAI(
                base_url=controller.url + "/v1", api_key=broke_key, max_retries=0
            ).chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=8)
        assert rl.value.code == "insufficient_quota"
        bad_jobs = (
            controller.get("/api/admin/jobs?state=RUNNING").json()
            + controller.get("/api/admin/jobs?state=QUEUED").json()
            + controller.get("/api/admin/jobs?state=DISPATCHED").json()
        )
        assert bad_jobs == []

        # Credits: the consumer is charged, each owner credited by its share, three receipts verify.
        def settled() -> Any:
            rs = controller.get(f"/api/credits/receipts?job={job_id}").json()
            rs = rs.get("results", rs) if isinstance(rs, dict) else rs
            return rs if len(rs) == 3 else None

        receipts = wait_for(settled, 60, "three receipts for the job")
        assert {r["node"] for r in receipts} == {
            n["id"] for n in controller.get("/api/admin/nodes").json()
        }
        assert sum(r["credits"] for r in receipts) > 0
        for r in receipts:
            v = controller.post("/api/credits/receipts/verify", {"receipt": r["document"]})
            assert v.status_code == 200 and v.json()["valid"] is True, v.text
        tampered = json.loads(json.dumps(receipts[0]["document"]))
        tampered["credits"] = int(tampered.get("credits", 0)) + 1
        assert (
            controller.post("/api/credits/receipts/verify", {"receipt": tampered}).json()["valid"]
            is False
        )
        consumer_balance = httpx.get(
            controller.url + "/api/credits/balance",
            headers={"Authorization": f"Bearer {consumer_key}"},
        ).json()
        from django.conf import settings as dj

        assert int(consumer_balance["balance"]) < dj.CREDITS_STARTING_GRANT
        for name, acct in owners.items():
            bal = controller.get(f"/api/credits/balance?account={acct}").json()
            assert int(bal["balance"]) > dj.CREDITS_STARTING_GRANT, (name, bal)

        # A client that disconnects mid-stream cancels the job and stops generation.
        with (
            httpx.Client(timeout=60) as h,
            connect_sse(
                h,
                "POST",
                controller.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {consumer_key}"},
                json={
                    "model": "smollm2",
                    "messages": [
                        {"role": "user", "content": "Write a long story about a lighthouse."}
                    ],
                    "max_tokens": 400,
                    "stream": True,
                },
            ) as s,
        ):
            assert s.response.status_code == 200, s.response.read()
            cancel_job = s.response.headers["x-racon-job-id"]
            seen = 0
            for event in s.iter_sse():
                if event.data.startswith("{"):
                    seen += 1
                if seen >= 4:
                    break
        cancelled = wait_for(
            lambda: (
                (j := controller.get(f"/api/admin/jobs/{cancel_job}").json())["state"]
                in ("CANCELLED", "COMPLETED", "FAILED")
                and j
            ),
            10,
            "the disconnected job to end",
        )
        assert cancelled["state"] == "CANCELLED", cancelled
        from apps.jobs.retention import job_stream_entries

        def stream_ended() -> Any:
            # The primary's last entry, from its stream or, once released, the controller's copy.
            ends = [
                fields
                for _, fields in job_stream_entries(job_id=cancel_job)
                if fields.get("type") in ("done", "error")
            ]
            return ends[-1] if ends else None

        final = wait_for(stream_ended, 5, "the primary to stop generating")
        assert final.get("finish_reason") in ("cancelled", "error"), final
        assert int(json.loads(final.get("usage") or "{}").get("completion_tokens", 0)) < 400

        # Kill an RPC worker mid-generation: the deployment fails and is replaced, and the job fails
        # over (issue 13): the stream ends with [DONE], either completed on the replacement or, when
        # no capacity appears in time, with a clear error. The primary's agent lives.
        primary_name = detail["primary_name"]
        primary_agent = next(a for a in agents if a.name == primary_name)
        victim = next(a for a in agents if a.name != primary_name)
        with (
            httpx.Client(timeout=120) as h,
            connect_sse(
                h,
                "POST",
                controller.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {consumer_key}"},
                json={
                    "model": "smollm2",
                    "messages": [
                        {"role": "user", "content": "Count from one to five hundred in words."}
                    ],
                    "max_tokens": 450,
                    "stream": True,
                },
            ) as s,
        ):
            assert s.response.status_code == 200, s.response.read()
            doomed = s.response.headers["x-racon-job-id"]
            # Raw events, not the SDK: the SDK raises on the error event, and this checks that
            # [DONE] still follows it.
            events: list[str] = []
            for event in s.iter_sse():
                events.append(event.data)
                if len(events) == 5:
                    os.kill(rpc_worker_pid(victim), signal.SIGKILL)
        assert events[-1] == "[DONE]"
        errored = any('"error"' in e for e in events)
        failed = wait_for(
            lambda: (
                (j := controller.get(f"/api/admin/jobs/{doomed}").json())["state"]
                in ("FAILED", "COMPLETED", "CANCELLED")
                and j
            ),
            30,
            "the doomed job to end",
        )
        # The stream's own ending and the job's record agree on what happened: completed (failed
        # over to a replacement, or the worker was lost after the last step that needed it), or
        # failed with the error the stream carried.
        kinds = [e["kind"] for e in controller.get(f"/api/admin/events?job={doomed}").json()]
        if failed["state"] == "COMPLETED":
            assert not errored, (kinds, events[-3:])
        else:
            assert failed["state"] == "FAILED" and failed["error"] and errored, (
                failed,
                events[-3:],
            )
        time.sleep(1)
        assert primary_agent.proc.poll() is None, "the primary's agent must stay up"
        if errored or "JOB_FAILOVER" in kinds:
            wait_for(
                lambda: (
                    controller.get(f"/api/admin/deployments/{dep_id}").json()["state"] == "FAILED"
                ),
                30,
                "the deployment to be marked FAILED",
            )
    finally:
        for a in agents:
            stop_agent(a)
