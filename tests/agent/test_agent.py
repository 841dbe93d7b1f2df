"""The Agent end to end with the fake runtime: real HTTP (fake controller), real Redis."""

from __future__ import annotations

import hashlib
import json
import socket
import stat
import time
import uuid
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.agent import EXIT_CONFIG, EXIT_REFUSED, AgentState
from agent.hardware.benchmark import speed_challenge_digest
from agent.protocol import (
    job_cancel_key,
    node_processing_key,
    node_queue_key,
)
from agent.runtime.fake import FAKE_TOKENS, FakeRuntime
from tests.agent.harness import (
    MODEL_BYTES,
    MODEL_SHA,
    Harness,
    fake_profile,
    free_port,
    read_stream,
    wait,
)

# --- lifecycle --------------------------------------------------------------------------------------


def test_agent_enrolls_with_hardware_then_heartbeats_ready(h: Harness) -> None:
    profile = fake_profile(
        h.tmp / "gpu", gpus=[{"name": "RTX 4090", "vram_total": 24 << 30, "vram_free": 20 << 30}]
    )
    agent = h.start(h.config(hardware_profile=profile))
    enroll = h.controller.enrolls[0]
    assert enroll["token"] == "good-token" and enroll["node_name"] == "test-node"
    assert enroll["hardware"]["gpus"][0]["name"] == "RTX 4090"
    assert enroll["hardware"]["benchmark"] == {"gflops": 100.0, "mem_bandwidth_gbps": 20.0}
    assert enroll["models"][0]["sha256"] == MODEL_SHA
    assert enroll["rpc_port"] == agent.config.rpc_port and len(enroll["machine_id"]) == 32
    beat = h.controller.wait_for(lambda c: [b for b in c.heartbeats if b["state"] == "READY"])[0]
    tele = beat["telemetry"]
    assert tele["gpu_free"] == [20 << 30]
    assert tele["rpc_worker"] == {"running": True, "endpoint": agent.config.rpc_endpoint}
    assert tele["primaries"] == [] and tele["jobs"] == []
    assert {"cpu_percent", "mem_available"} <= tele.keys()
    started = h.controller.wait_for(lambda c: c.events("RPC_WORKER_STARTED"))[0]
    assert started["data"]["endpoint"] == agent.config.rpc_endpoint
    ident = agent.config.identity_path
    assert stat.S_IMODE(ident.stat().st_mode) == 0o600
    assert json.loads(ident.read_text())["node_id"] == agent.node_id
    assert agent.heartbeat_interval == h.controller.heartbeat_interval


def test_restart_resumes_with_the_stored_credential_without_enrolling_again(h: Harness) -> None:
    cfg = h.config()
    first = h.start(cfg)
    node = first.node_id
    assert h.stop(first) == 0
    cfg.enrollment_token = None  # a resumed agent does not need the token any more
    second = h.start(cfg)
    assert second.node_id == node
    assert len(h.controller.enrolls) == 1
    assert h.controller.wait_for(lambda c: c.events("HARDWARE_UPDATED"))
    h.controller.wait_for(
        lambda c: [b for b in c.heartbeats[-3:] if b["node_id"] == node and b["state"] == "READY"]
    )


def test_a_credential_the_controller_forgot_is_replaced_by_enrolling_again(h: Harness) -> None:
    cfg = h.config()
    first = h.start(cfg)
    old = first.node_id
    assert h.stop(first) == 0
    h.controller.credentials.clear()  # the controller's database was reset
    second = h.start(cfg)
    assert second.node_id != old
    assert len(h.controller.enrolls) == 2
    assert json.loads(cfg.identity_path.read_text())["node_id"] == second.node_id


def test_a_revoked_credential_stops_the_agent_at_start(h: Harness) -> None:
    cfg = h.config()
    first = h.start(cfg)
    assert h.stop(first) == 0
    h.controller.revoked.add(first.node_id)  # type: ignore[arg-type]
    second = h.start(cfg, wait=False)
    assert h.stop(second) == EXIT_REFUSED
    assert len(h.controller.enrolls) == 1


def test_no_token_and_no_stored_credential_exits_with_a_config_error(h: Harness) -> None:
    agent = h.start(h.config(enrollment_token=None), wait=False)
    assert h.stop(agent) == EXIT_CONFIG
    assert h.controller.enrolls == []


def test_a_refused_enrollment_token_stops_the_agent(h: Harness) -> None:
    agent = h.start(h.config(enrollment_token="wrong"), wait=False)
    _, t, box = h.agents[-1]
    t.join(15)
    assert box.get("code") == EXIT_REFUSED
    assert agent.state == AgentState.ERROR


def test_a_revoked_node_is_told_so_and_stops(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    agent = h.start()
    h.controller.revoked.add(agent.node_id)  # type: ignore[arg-type]
    _, t, box = h.agents[-1]
    t.join(15)
    assert not t.is_alive()
    assert box["code"] == EXIT_REFUSED
    assert any("revoked" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def test_controller_outage_at_enrollment_is_retried_until_it_answers(h: Harness) -> None:
    h.controller.fail_all = True
    agent = h.start(wait=False)
    time.sleep(1.0)
    assert agent.state in (AgentState.UNINITIALIZED, AgentState.REGISTERING)
    h.controller.fail_all = False
    assert agent.wait_ready(20)
    assert len(h.controller.enrolls) == 1


def test_metrics_endpoint_serves_the_agent_state(h: Harness) -> None:
    port = free_port()
    agent = h.start(h.config(metrics_port=port))
    body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert samples[("racon_agent_state", (("state", "READY"),))] == 1
    assert samples[("racon_agent_rpc_worker_up", ())] == 1
    assert agent.state == AgentState.READY


# --- commands ----------------------------------------------------------------------------------------


def test_load_and_run_job_streams_tokens_and_reports_usage(h: Harness) -> None:
    agent = h.start()
    dep, result = h.load(agent)
    assert result["command"] == "load_primary"
    assert result["deployment_id"] == dep and result["assignment"][0]["device"] == "CPU"
    job = h.job(dep)
    cid = h.send(agent, "run_job", job)
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    # An accepted run_job is acknowledged without a command_result (its outcome is job_finished).
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)
    assert not [r for r in h.controller.reports if r.get("command_id") == cid]
    assert done["status"] == "completed" and done["finish_reason"] == "stop"
    assert done["completion_tokens"] == len(FAKE_TOKENS)
    entries = read_stream(h.r, job["job_id"])
    assert "".join(e["text"] for e in entries) == "".join(FAKE_TOKENS)
    assert [int(e["seq"]) for e in entries] == list(range(len(FAKE_TOKENS) + 1))
    assert entries[-1]["type"] == "done"
    assert json.loads(entries[-1]["usage"])["completion_tokens"] == len(FAKE_TOKENS)
    # Every command was acknowledged once its report was accepted.
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)
    beat = h.controller.wait_for(
        lambda c: [b for b in c.heartbeats if dep in b["telemetry"]["primaries"]]
    )
    assert beat


def test_run_job_sent_right_behind_load_waits_for_the_load(h: Harness) -> None:
    agent = h.start()
    plan = h.plan()
    job = h.job(plan["deployment_id"])
    h.send(agent, "load_primary", plan)
    h.send(agent, "run_job", job)
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "completed"


def test_a_job_sent_to_a_primary_that_died_unnoticed_ends_as_a_failover_cause(h: Harness) -> None:
    # The reliability suite's primary kill: a job dispatched in the moment between llama-server's
    # death and the agent noticing it got an error without a code, so the client saw a 502
    # instead of the job moving to the other replica.
    agent = h.start()
    dep, _ = h.load(agent)
    held = agent.registry.get(dep)
    assert held is not None and held.primary is not None
    held.primary._alive = False  # type: ignore[attr-defined]  # the fake primary's own flag
    job = h.job(dep, attempt=2)
    h.send(agent, "run_job", job)
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "failed" and "not running" in done["error"]
    entries = read_stream(h.r, job["job_id"])
    assert entries[-1]["type"] == "error" and entries[-1]["code"] == "primary_died"
    assert entries[-1]["attempt"] == "2"  # the failover attempt's reader sees it


def test_cancel_job_stops_generation_within_a_token(h: Harness) -> None:
    agent = h.start(
        runtime=FakeRuntime(tokens=tuple(f" t{i}" for i in range(200)), token_delay=0.05)
    )
    dep, _ = h.load(agent)
    job = h.job(dep, max_tokens=500)
    h.send(agent, "run_job", job)
    wait(lambda: len(read_stream(h.r, job["job_id"])) >= 2)
    res = h.controller.result(h.send(agent, "cancel_job", {"job_id": job["job_id"]}))
    assert res["ok"] and res["cancelled"] is True
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "cancelled"
    assert done["completion_tokens"] < 200
    assert read_stream(h.r, job["job_id"])[-1]["finish_reason"] == "cancelled"


def test_the_gateway_cancel_key_stops_a_running_job(h: Harness) -> None:
    agent = h.start(
        runtime=FakeRuntime(tokens=tuple(f" t{i}" for i in range(200)), token_delay=0.05)
    )
    dep, _ = h.load(agent)
    job = h.job(dep, max_tokens=500)
    h.send(agent, "run_job", job)
    wait(lambda: len(read_stream(h.r, job["job_id"])) >= 2)
    h.r.set(job_cancel_key(job["job_id"], str(agent.node_id)), "1", ex=60)
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "cancelled"


def test_a_primary_crash_mid_job_fails_the_job_and_the_agent_stays_up(h: Harness) -> None:
    runtime = FakeRuntime(tokens=tuple(f" t{i}" for i in range(200)), token_delay=0.05)
    agent = h.start(runtime=runtime)
    dep, _ = h.load(agent)
    job = h.job(dep, max_tokens=500)
    h.send(agent, "run_job", job)
    wait(lambda: len(read_stream(h.r, job["job_id"])) >= 2)
    runtime.primaries[-1].crash("RPC worker disconnected: peer 10.0.0.7:50052 died")
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "failed" and "RPC worker disconnected" in done["error"]
    entries = read_stream(h.r, job["job_id"])
    assert entries[-1]["type"] == "error" and "RPC worker disconnected" in entries[-1]["text"]
    assert h.controller.wait_for(lambda c: c.events("RUNTIME_FAILED"))
    wait(lambda: dep not in agent.telemetry()["primaries"])
    assert agent.state == AgentState.READY
    # ...and it still takes commands.
    assert h.controller.result(h.send(agent, "rescan_models"))["ok"]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda h: ("teleport", {}), "unknown command kind 'teleport'"),
        (lambda h: ("load_primary", {"deployment_id": "x"}), "malformed load_primary: missing"),
        (
            lambda h: ("load_primary", h.plan(model_path="absent.gguf")),
            "model file not found: absent.gguf",
        ),
        (lambda h: ("load_primary", h.plan(sha256="ab" * 32)), "model file not found: sha256"),
        (
            lambda h: ("load_primary", h.plan(model_path="tiny.gguf", sha256="ab" * 32)),
            "sha256 mismatch",
        ),
        (
            lambda h: ("load_primary", h.plan(memory_bytes=64 << 30)),
            "plan needs 64.00 GiB on the primary",
        ),
        (
            lambda h: ("load_primary", h.plan(rpc_endpoints=["8.8.8.8:50052"])),
            "Public IP security violation",
        ),
        (lambda h: ("load_primary", h.plan(rpc_endpoints=["nonsense"])), "malformed endpoint"),
        (
            lambda h: (
                "run_job",
                {
                    "job_id": "j-x",
                    "deployment_id": "nope",
                    "kind": "chat",
                    "messages": [{"role": "user", "content": "x"}],
                },
            ),
            "not loaded on this node",
        ),
        (
            lambda h: ("run_job", {"job_id": "j-y", "deployment_id": "d", "kind": "chat"}),
            "needs 'messages'",
        ),
        (lambda h: ("cancel_job", {}), "malformed cancel_job"),
        (lambda h: ("probe_links", {"peers": "x"}), "'peers' must be a list"),
        (lambda h: ("fetch_model", {"sha256": "00"}), "malformed fetch_model"),
    ],
)
def test_bad_commands_are_reported_clearly_and_never_crash_the_agent(
    h: Harness, make: Any, needle: str
) -> None:
    agent = h.start()
    kind, payload = make(h)
    if kind == "run_job":
        h.r.test_keys.append(f"racon:n:*:{payload['job_id']}")
    res = h.controller.result(h.send(agent, kind, payload))
    assert res["ok"] is False
    assert needle in res["error"]
    assert agent.state == AgentState.READY
    assert h.controller.result(h.send(agent, "rescan_models"))["ok"]
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)


def test_malformed_json_is_reported_and_dropped(h: Harness) -> None:
    agent = h.start()
    h.r.rpush(node_queue_key(agent.node_id), "{not json")  # type: ignore[arg-type]
    report = h.controller.wait_for(
        lambda c: [r for r in c.reports if r["kind"] == "command_result" and not r["payload"]["ok"]]
    )[0]
    assert "not JSON" in report["payload"]["error"] and report["command_id"] is None
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)


def test_a_job_for_an_unknown_deployment_ends_its_stream_with_an_error(h: Harness) -> None:
    agent = h.start()
    job = h.job("no-such-deployment")
    h.send(agent, "run_job", job)
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "failed"
    entries = read_stream(h.r, job["job_id"])
    assert entries[-1]["type"] == "error" and "not loaded" in entries[-1]["text"]


def test_a_public_rpc_endpoint_raises_a_security_violation_event(h: Harness) -> None:
    agent = h.start()
    h.controller.result(
        h.send(agent, "load_primary", h.plan(rpc_endpoints=["10.1.2.3:50052", "1.2.3.4:50052"]))
    )
    ev = h.controller.wait_for(lambda c: c.events("PUBLIC_IP_VIOLATION"))[0]
    assert (
        ev["message"].startswith("Public IP security violation")
        and ev["data"]["address"] == "1.2.3.4"
    )


def test_a_public_advertise_address_is_refused_and_the_node_is_not_ready(h: Harness) -> None:
    agent = h.start(h.config(advertise_address="8.8.4.4"), wait=False)
    ev = h.controller.wait_for(lambda c: c.events("PUBLIC_IP_VIOLATION"))[0]
    assert "8.8.4.4" in ev["message"]
    h.controller.wait_for(lambda c: [b for b in c.heartbeats if b["state"] == "ERROR"])
    assert not agent.wait_ready(0.2)


def test_rpc_port_in_use_is_reported_and_rpc_start_recovers_later(h: Harness) -> None:
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen(1)
    agent = h.start(h.config(rpc_port=port), wait=False)
    failed = h.controller.wait_for(lambda c: c.events("RPC_WORKER_FAILED"))[0]
    assert f"RPC port {port} on 127.0.0.1 is already in use" in failed["message"]
    h.controller.wait_for(lambda c: [b for b in c.heartbeats if b["state"] == "DEGRADED"])
    squatter.close()
    h.r.test_keys.append(f"racon:node:{agent.node_id}:*")
    assert h.controller.result(h.send(agent, "rpc_start"))["ok"]
    assert agent.wait_ready(5)


def test_rpc_stop_and_start_commands(h: Harness) -> None:
    agent = h.start()
    res = h.controller.result(h.send(agent, "rpc_stop"))
    assert res["ok"] and res["rpc_worker"]["running"] is False
    assert agent.telemetry()["rpc_worker"]["running"] is False
    res = h.controller.result(h.send(agent, "rpc_start"))
    assert res["ok"] and res["rpc_worker"]["running"] is True


def test_controller_5xx_on_reports_delays_the_ack_until_accepted(h: Harness) -> None:
    agent = h.start()
    # Only the command's result is refused: the agent's own start-up reports (events) could
    # otherwise take the 503s, and the result would be accepted at once (seen once in CI).
    h.controller.fail_report_kind = "command_result"
    h.controller.fail_reports = 3
    cid = h.send(agent, "rescan_models")
    h.controller.wait_for(lambda c: c.rejected_reports >= 1)
    assert h.r.llen(node_processing_key(str(agent.node_id))) == 1  # taken, not yet acknowledged
    res = h.controller.result(cid, timeout=20)
    assert res["ok"]
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)
    assert len(h.controller.results_for(cid)) == 1


def test_a_duplicate_command_id_runs_once(h: Harness) -> None:
    agent = h.start()
    cid = h.send(agent, "rescan_models")
    h.controller.result(cid)
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)
    h.send(agent, "rescan_models", cid=cid)  # re-delivered
    marker = h.send(agent, "rpc_start")
    h.controller.result(marker)  # commands run in order, so the duplicate was seen by now
    # The controller never sends an id twice: the copy is refused as a replay, not run.
    first, again = (r["payload"] for r in h.controller.results_for(cid))
    assert first["ok"] and again["ok"] is False and again["code"] == "command_replayed"
    assert len([r for r in h.controller.reports if r["kind"] == "models"]) == 1
    wait(lambda: h.r.llen(node_processing_key(str(agent.node_id))) == 0)


def test_a_command_left_in_processing_by_a_crash_runs_after_restart(h: Harness) -> None:
    cfg = h.config()
    agent = h.start(cfg)
    node = agent.node_id
    assert h.stop(agent) == 0
    cid = uuid.uuid4().hex
    assert node is not None
    raw = h.signed(node, "rescan_models", {}, cid=cid)
    h.r.rpush(node_processing_key(node), raw)  # taken, then crashed
    h.start(cfg)
    assert h.controller.result(cid)["ok"]
    wait(lambda: h.r.llen(node_processing_key(node)) == 0)


def test_probe_links_and_rescan_send_their_reports(h: Harness) -> None:
    agent = h.start()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    peers = [
        {"node_id": "a", "address": "127.0.0.1", "rpc_port": port},
        {"node_id": "b", "address": "9.9.9.9", "rpc_port": 50052},
    ]
    res = h.controller.result(h.send(agent, "probe_links", {"peers": peers}))
    srv.close()
    assert res == {"ok": True, "command": "probe_links", "links": 2, "failed": 1}
    links = h.controller.wait_for(lambda c: [r for r in c.reports if r["kind"] == "links"])[0][
        "payload"
    ]["links"]
    assert links[0]["node_id"] == "a" and links[0]["rtt_ms"] > 0 and links[0]["bandwidth_mbps"] > 0
    assert "Public IP security violation" in links[1]["error"]
    assert h.controller.events("PUBLIC_IP_VIOLATION")
    h.controller.result(h.send(agent, "rescan_models"))
    models = h.controller.wait_for(lambda c: [r for r in c.reports if r["kind"] == "models"])[0][
        "payload"
    ]["models"]
    assert [m["sha256"] for m in models] == [MODEL_SHA]


def test_fetch_model_verifies_sha_and_keeps_no_bad_file(h: Harness) -> None:
    agent = h.start()
    data = b"GGUF-new-model" * 1000
    h.controller.files["good.gguf"] = data
    bad = h.controller.result(
        h.send(
            agent,
            "fetch_model",
            {
                "sha256": "0" * 64,
                "file_name": "bad.gguf",
                "size": len(data),
                "url": "/files/good.gguf",
            },
        )
    )
    assert bad["ok"] is False and "sha256 mismatch" in bad["error"]
    assert not (agent.config.models_dir / "bad.gguf").exists()
    assert not (agent.config.models_dir / "bad.gguf.part").exists()
    good = h.controller.result(
        h.send(
            agent,
            "fetch_model",
            {
                "sha256": hashlib.sha256(data).hexdigest(),
                "file_name": "good.gguf",
                "size": len(data),
                "url": f"{h.controller.url}/files/good.gguf",
            },
        )
    )
    assert good["ok"], good
    assert (agent.config.models_dir / "good.gguf").read_bytes() == data


def test_unload_stops_the_deployment(h: Harness) -> None:
    agent = h.start()
    dep, _ = h.load(agent)
    res = h.controller.result(h.send(agent, "unload", {"deployment_id": dep}))
    assert res["ok"] and res["unloaded"] is True
    assert dep not in agent.telemetry()["primaries"]
    again = h.controller.result(h.send(agent, "unload", {"deployment_id": dep}))
    assert again["ok"] and again["unloaded"] is False


def test_stop_drains_cancels_work_past_the_bound_and_exits_zero(h: Harness) -> None:
    runtime = FakeRuntime(tokens=tuple(f" t{i}" for i in range(1000)), token_delay=0.05)
    agent = h.start(h.config(drain_seconds=0.3), runtime=runtime)
    dep, _ = h.load(agent)
    job = h.job(dep, max_tokens=2000)
    h.send(agent, "run_job", job)
    wait(lambda: len(read_stream(h.r, job["job_id"])) >= 2)
    assert h.stop(agent) == 0
    done = h.controller.wait_for(lambda c: c.job_finished(job["job_id"]))[0]
    assert done["status"] == "cancelled"
    drained = h.controller.wait_for(lambda c: c.events("NODE_DRAINED"))[0]
    assert drained["data"]["jobs_cancelled"] == [job["job_id"]]
    assert h.controller.heartbeats[-1]["state"] == "DRAINING"


def test_stop_lets_short_work_finish_within_the_bound(h: Harness) -> None:
    runtime = FakeRuntime(tokens=tuple(f" t{i}" for i in range(10)), token_delay=0.05)
    agent = h.start(h.config(drain_seconds=10), runtime=runtime)
    dep, _ = h.load(agent)
    job = h.job(dep)
    h.send(agent, "run_job", job)
    wait(lambda: len(read_stream(h.r, job["job_id"])) >= 1)
    assert h.stop(agent) == 0
    assert h.controller.job_finished(job["job_id"])[0]["status"] == "completed"


def test_a_hash_challenge_is_answered_from_the_file_itself(h: Harness) -> None:
    agent = h.start()
    nonce = "ab" * 16
    # The file is under 64 KiB: only the whole of it can be asked for.
    whole = {"sha256": MODEL_SHA, "offset": 0, "length": len(MODEL_BYTES), "nonce": nonce}
    res = h.controller.result(h.send(agent, "hash_challenge", whole))
    assert (
        res["ok"]
        and res["digest"] == hashlib.sha256(bytes.fromhex(nonce) + MODEL_BYTES).hexdigest()
    )
    short = h.controller.result(
        h.send(
            agent, "hash_challenge", {"sha256": MODEL_SHA, "offset": 2, "length": 5, "nonce": nonce}
        )
    )
    assert not short["ok"] and short["code"] == "challenge_range" and "digest" not in short
    missing = h.controller.result(
        h.send(
            agent, "hash_challenge", {"sha256": "0" * 64, "offset": 0, "length": 5, "nonce": nonce}
        )
    )
    assert not missing["ok"] and "no file" in missing["error"]
    bad = h.controller.result(
        h.send(
            agent,
            "hash_challenge",
            {"sha256": MODEL_SHA, "offset": -1, "length": 5, "nonce": nonce},
        )
    )
    assert not bad["ok"] and "malformed" in bad["error"]


def test_a_speed_challenge_is_answered_with_the_chain_the_controller_recomputes(h: Harness) -> None:
    agent = h.start()
    res = h.controller.result(h.send(agent, "speed_challenge", {"seed": 12345, "n": 64, "reps": 3}))
    assert res["ok"] and res["digest"] == speed_challenge_digest(seed=12345, n=64, reps=3)
    bad = h.controller.result(h.send(agent, "speed_challenge", {"seed": 1, "n": 64, "reps": 10**6}))
    assert not bad["ok"] and "malformed speed_challenge" in bad["error"]
