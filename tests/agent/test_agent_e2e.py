"""Three real Agents with the real runtime: two lend their CPU over ggml-rpc, one runs the primary.

Commands go through each node's Redis queue and results come back as reports, exactly as the
controller will drive them; only the controller itself is the test's fake.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from typing import Any

import pytest

from agent.agent import AgentState
from agent.runtime.ggml import load_llama_cpp_backends
from agent.runtime.llama import LlamaRuntime
from tests.agent.harness import MODEL, Harness, deployment_tls, read_stream, wait

pytestmark = pytest.mark.e2e


def test_three_agents_split_a_model_and_survive_a_worker_dying_mid_generation(h: Harness) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    load_llama_cpp_backends()  # a GPU build's (GGML_BACKEND_DL) backends are modules in its lib/
    if not llama_cpp.llama_supports_rpc() or not MODEL.is_file():
        pytest.skip("needs llama-cpp-python with RPC and the SmolLM2 model")
    empty = h.tmp / "no-models"
    a = h.start(
        h.config(state_dir=h.tmp / "a", models_dir=empty, node_name="rpc-a"), runtime=LlamaRuntime()
    )
    b = h.start(
        h.config(state_dir=h.tmp / "b", models_dir=empty, node_name="rpc-b"), runtime=LlamaRuntime()
    )
    c = h.start(
        h.config(
            state_dir=h.tmp / "c", models_dir=MODEL.parent, node_name="primary", rpc_worker=False
        ),
        runtime=LlamaRuntime(),
    )
    started = h.controller.wait_for(
        lambda ctl: len(ctl.events("RPC_WORKER_STARTED")) >= 2 and ctl.events("RPC_WORKER_STARTED")
    )
    assert {e["data"]["endpoint"] for e in started} == {
        a.config.rpc_endpoint,
        b.config.rpc_endpoint,
    }
    sha = next(e for e in h.controller.enrolls if e["node_name"] == "primary")["models"][0][
        "sha256"
    ]

    plan = h.plan(
        model_name="smollm2",
        sha256=sha,
        n_ctx=1024,
        tensor_split=[1.0, 1.0, 0.0],
        rpc_endpoints=[a.config.rpc_endpoint, b.config.rpc_endpoint],
        rpc_tunnel_key=secrets.token_hex(32),
    )
    tls = deployment_tls(plan["deployment_id"]).to_wire()
    plan["rpc_tunnel_tls"] = tls
    # As the controller does: each worker lets this deployment's primary through its tunnel.
    for worker in (a, b):
        grant = {
            "deployment_id": plan["deployment_id"],
            "tunnel_key": plan["rpc_tunnel_key"],
            "tunnel_tls": tls,
            "primary_address": "127.0.0.1",
        }
        assert h.controller.result(h.send(worker, "rpc_start", grant))["ok"]
    loaded = h.controller.result(h.send(c, "load_primary", plan), timeout=120)
    assert loaded["ok"], loaded
    devices = {x["device"]: x for x in loaded["assignment"]}
    assert devices["RPC0"]["endpoint"] == a.config.rpc_endpoint and devices["RPC0"]["n_layers"] > 0
    assert devices["RPC1"]["endpoint"] == b.config.rpc_endpoint and devices["RPC1"]["n_layers"] > 0
    assert set(loaded["layer_devices"].values()) == {"RPC0", "RPC1"}
    assert loaded["model_path"] == str(MODEL.resolve())

    chat = h.job(
        plan["deployment_id"], messages=[{"role": "user", "content": "Say hello."}], max_tokens=16
    )
    h.send(c, "run_job", chat)
    done = h.controller.wait_for(lambda ctl: ctl.job_finished(chat["job_id"]), timeout=60)[0]
    assert done["status"] == "completed" and done["completion_tokens"] > 0
    assert done["ttft_ms"] > 0

    # A long generation (inside the 1,024-token slot: a longer request is refused), then
    # worker B dies under it.
    long = h.job(
        plan["deployment_id"], kind="completion", prompt="1, 2, 3, 4, 5, 6, 7,", max_tokens=900
    )
    del long["messages"]
    h.send(c, "run_job", long)
    wait(lambda: len(read_stream(h.r, long["job_id"])) >= 3, timeout=60)
    assert b.rpc_worker is not None
    os.kill(b.rpc_worker.pid, signal.SIGKILL)  # type: ignore[attr-defined]

    failed = h.controller.wait_for(lambda ctl: ctl.job_finished(long["job_id"]), timeout=60)[0]
    assert failed["status"] == "failed"
    assert failed["error"].startswith("RPC worker disconnected"), failed["error"]
    entries = read_stream(h.r, long["job_id"])
    assert entries[-1]["type"] == "error" and "RPC worker disconnected" in entries[-1]["text"]
    assert [int(e["seq"]) for e in entries] == list(range(len(entries)))  # one gap-free stream
    runtime_failed = h.controller.wait_for(lambda ctl: ctl.events("RUNTIME_FAILED"))[0]
    assert runtime_failed["data"]["deployment_id"] == plan["deployment_id"]

    # The primary's agent is still up and schedulable, with the dead deployment gone...
    assert c.state == AgentState.READY and not c.stopping
    wait(lambda: plan["deployment_id"] not in c.telemetry()["primaries"])
    assert h.controller.result(h.send(c, "rescan_models"))["ok"]
    # ...and worker B's supervisor restarted its ggml-rpc server.
    b_failed = h.controller.wait_for(
        lambda ctl: [
            e
            for e in ctl.events("RPC_WORKER_FAILED")
            if e["data"].get("endpoint") == b.config.rpc_endpoint
        ]
    )
    assert "exited with code -9" in b_failed[0]["message"]
    h.controller.wait_for(
        lambda ctl: [
            e
            for e in ctl.events("RPC_WORKER_STARTED")
            if e["data"]["endpoint"] == b.config.rpc_endpoint
        ][1:],
        timeout=30,
    )
    assert b.rpc_worker.running


def test_load_primary_result_payload_is_json_for_the_controller(h: Harness) -> None:
    """The command_result of load_primary survives a JSON round trip with its assignment intact."""
    llama_cpp = pytest.importorskip("llama_cpp")
    load_llama_cpp_backends()  # a GPU build's (GGML_BACKEND_DL) backends are modules in its lib/
    if not MODEL.is_file() or not llama_cpp.llama_supports_rpc():
        pytest.skip("needs the SmolLM2 model")
    c = h.start(
        h.config(state_dir=h.tmp / "c", models_dir=MODEL.parent, rpc_worker=False),
        runtime=LlamaRuntime(),
    )
    sha = h.controller.enrolls[0]["models"][0]["sha256"]
    plan: dict[str, Any] = h.plan(model_name="smollm2", sha256=sha, n_ctx=256, n_gpu_layers=0)
    res = h.controller.result(h.send(c, "load_primary", plan), timeout=120)
    assert res["ok"], res
    assert json.loads(json.dumps(res)) == res
    assert {x["device"] for x in res["assignment"]} == {"CPU"}
    assert res["assignment"][0]["n_layers"] == 31  # 30 blocks + the output layer
