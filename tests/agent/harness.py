"""A test harness running real Agent objects (in threads) against the fake controller."""

from __future__ import annotations

import hashlib
import json
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.agent import Agent
from agent.config import AgentConfig
from agent.protocol import command_signature, node_queue_key
from agent.runtime.fake import FakeRuntime
from agent.tunnel import TunnelTls
from racon.tls import ca_load_or_create, issue_leaf

if TYPE_CHECKING:
    from tests.agent.conftest import FakeController

MODEL_BYTES = b"GGUF" + bytes(range(256)) * 64
MODEL_SHA = hashlib.sha256(MODEL_BYTES).hexdigest()


class Harness:
    def __init__(self, controller: FakeController, redis_client: Any, tmp_path: Path) -> None:
        self.controller = controller
        self.r = redis_client
        self.tmp = tmp_path
        self.agents: list[tuple[Agent, threading.Thread, dict[str, Any]]] = []

    def config(self, **kw: Any) -> AgentConfig:
        models = self.tmp / "models"
        if "models_dir" not in kw:
            models.mkdir(exist_ok=True)
            (models / "tiny.gguf").write_bytes(MODEL_BYTES)
        defaults: dict[str, Any] = {
            "controller_url": self.controller.url,
            "node_name": "test-node",
            "state_dir": self.tmp / "state",
            "models_dir": models,
            "advertise_address": "127.0.0.1",
            "enrollment_token": self.controller.token,
            "rpc_port": free_port(),
            "run_benchmarks": False,
            "drain_seconds": 2.0,
            "rpc_threads": 1,  # three ggml processes share 2 cores in CI
        }
        defaults.update(kw)
        if "hardware_profile" not in kw:
            defaults["hardware_profile"] = fake_profile(self.tmp)
        return AgentConfig(**defaults)

    def start(
        self, config: AgentConfig | None = None, *, runtime: Any = None, wait: bool = True
    ) -> Agent:
        config = config or self.config()
        agent = Agent(config, runtime=runtime or FakeRuntime(), install_signals=False)
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.setdefault("code", agent.run()), daemon=True)
        t.start()
        self.agents.append((agent, t, box))
        if wait:
            assert agent.wait_ready(15), f"agent never became READY (state {agent.state})"
            self.r.test_keys.append(f"racon:node:{agent.node_id}:*")
        return agent

    def stop(self, agent: Agent, timeout: float = 20) -> int | None:
        for a, t, box in self.agents:
            if a is agent:
                a.request_stop("test over")
                t.join(timeout)
                assert not t.is_alive(), "agent did not stop"
                return box.get("code")
        raise AssertionError("unknown agent")

    def send(self, agent: Agent, kind: str, payload: Any = None, *, cid: str | None = None) -> str:
        """Push a command signed as the controller signs it (apps/nodes/commands.py)."""
        cid = cid or uuid.uuid4().hex
        assert agent.node_id is not None
        raw = self.signed(agent.node_id, kind, payload or {}, cid=cid)
        self.r.rpush(node_queue_key(agent.node_id), raw)
        return cid

    def signed(
        self,
        node_id: str,
        kind: str,
        payload: dict[str, Any],
        *,
        cid: str | None = None,
        issued_at: float | None = None,
    ) -> str:
        """The queue item of a command for node_id, signed with that node's command key."""
        cid = cid or uuid.uuid4().hex
        issued = time.time() if issued_at is None else issued_at
        key = bytes.fromhex(self.controller.command_keys[node_id])
        sig = command_signature(
            key, node_id=node_id, command_id=cid, kind=kind, payload=payload, issued_at=issued
        )
        body = {"id": cid, "kind": kind, "payload": payload, "issued_at": issued}
        return json.dumps({**body, "node_id": node_id, "sig": sig})

    def plan(self, **kw: Any) -> dict[str, Any]:
        plan: dict[str, Any] = {
            "deployment_id": "dep-" + uuid.uuid4().hex[:8],
            "model_name": "tiny",
            "sha256": MODEL_SHA,
            "rpc_endpoints": [],
            "tensor_split": [],
            "n_gpu_layers": -1,
            "n_ctx": 512,
            "n_parallel": 1,
            "n_threads": 1,
        }
        plan.update(kw)
        return plan

    def load(self, agent: Agent, **kw: Any) -> tuple[str, dict[str, Any]]:
        plan = self.plan(**kw)
        result = self.controller.result(self.send(agent, "load_primary", plan))
        assert result["ok"], result
        return plan["deployment_id"], result

    def job(self, dep: str, **kw: Any) -> dict[str, Any]:
        job: dict[str, Any] = {
            "job_id": new_job_id(self.r),
            "deployment_id": dep,
            "kind": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 32,
            "temperature": 0.0,
            "top_p": 1.0,
            "stop": [],
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
        job.update(kw)
        return job

    def close(self) -> None:
        for a, t, _ in self.agents:
            a.request_stop("teardown")
            t.join(20)


_CA_DIR = Path(tempfile.mkdtemp(prefix="racon-test-ca-"))


def deployment_tls(deployment_id: str) -> TunnelTls:
    """A deployment's tunnel certificate as the controller issues it (apps/jobs/placement.py):
    one leaf from a CA (one per test process), for server and client use."""
    ca, _ = ca_load_or_create(var_dir=_CA_DIR)
    leaf = issue_leaf(ca, common_name=f"racon-tunnel {deployment_id}", server=True, client=True)
    return TunnelTls(cert=leaf.cert_pem.decode(), key=leaf.key_pem.decode(), ca=ca.pem().decode())


def wait(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {predicate}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_job_id(redis_client: Any) -> str:
    jid = "job-" + uuid.uuid4().hex[:12]
    redis_client.test_keys.append(f"racon:n:*:{jid}")
    return jid


def fake_profile(tmp_path: Path, **sections: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "profile.json"
    base: dict[str, Any] = {
        "cpu": {
            "model": "Test CPU 9000",
            "physical_cores": 8,
            "logical_cores": 16,
            "flags": ["avx2"],
        },
        "memory": {"total": 32 * 2**30, "available": 28 * 2**30},
        "benchmark": {"gflops": 100.0, "mem_bandwidth_gbps": 20.0},
    }
    base.update(sections)
    path.write_text(json.dumps(base))
    return path
