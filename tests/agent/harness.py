"""The agent tests' helpers: a small real HTTP server playing the controller (FakeController), a
harness running real Agent objects (in threads) against it, and the real model's path. Imported by
tests/agent/conftest.py (the fixtures) and by the tests; no Django anywhere."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.agent import Agent
from agent.config import AgentConfig
from agent.protocol import (
    PROTOCOL_PATH,
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOL_VERSIONS,
    command_signature,
    node_queue_key,
)
from agent.runtime.fake import FakeRuntime
from agent.tunnel import TunnelTls
from racon.tls import ca_load_or_create, issue_leaf
from tests.smollm2 import NAME, smollm2_path
from tests.support.processes import free_port
from tests.support.unavailable import unavailable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

REDIS_URL = os.environ.get("RACON_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _model() -> Path:
    """The real SmolLM2 (downloaded once into the user cache when the checkout has none)."""
    try:
        return smollm2_path()
    except Exception:  # no registry reachable: the real-model tests skip, saying why
        return REPO / "var" / "models" / NAME


MODEL = _model()


def read_stream(r: Any, job_id: str) -> list[dict[str, str]]:
    """The job's stream, under whichever node prefix wrote it (protocol.job_stream_key)."""
    keys = list(r.scan_iter(match=f"racon:n:*:job:{job_id}", count=1000))
    return [fields for _, fields in r.xrange(keys[0])] if keys else []


class FakeController:
    """Enough of the controller's agent API to drive a real Agent, recording what it receives."""

    def __init__(self, redis_url: str = REDIS_URL) -> None:
        self.redis_url = redis_url
        self.token = "good-token"
        self.heartbeat_interval = 0.3
        self.enrolls: list[dict[str, Any]] = []
        self.heartbeats: list[dict[str, Any]] = []
        self.reports: list[dict[str, Any]] = []
        self.rejected_reports = 0
        self.fail_reports = 0  # answer the next N report posts with 503
        self.fail_report_kind: str | None = None  # only reports of this kind count (None: any)
        self.fail_all = False  # answer everything with 503
        self.revoked: set[str] = set()
        self.credentials: dict[str, str] = {}
        self.command_keys: dict[str, str] = {}  # node id → hex key its commands are signed with
        self.give_command_key = True  # False: an older controller's enrollment answer
        self.node_ids: list[str] = []
        self.files: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {"status": "ok"})
                elif self.path == PROTOCOL_PATH:
                    self._send(
                        200,
                        {
                            "protocol_version": PROTOCOL_VERSION,
                            "supported_protocol_versions": list(SUPPORTED_PROTOCOL_VERSIONS),
                        },
                    )
                elif self.path.startswith("/files/") and self.path[7:] in outer.files:
                    data = outer.files[self.path[7:]]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                status, resp = outer.handle(self.path, self.headers.get("Authorization", ""), body)
                self._send(status, resp)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _auth(self, header: str) -> tuple[int, Any] | str:
        if not header.startswith("Node "):
            return 401, {"error": {"message": "missing node credential"}}
        node_id, _, cred = header[5:].partition(":")
        if node_id in self.revoked:
            return 401, {
                "error": {"message": f"node {node_id} has been revoked", "code": "node_revoked"}
            }
        if self.credentials.get(node_id) != cred:
            return 401, {"error": {"message": "unknown node credential"}}
        return node_id

    def handle(self, path: str, auth: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self.cond:
            try:
                if self.fail_all:
                    return 503, {"error": "maintenance"}
                if path == "/api/agent/enroll":
                    if body.get("token") != self.token:
                        return 401, {"error": {"message": "invalid enrollment token"}}
                    node_id = "node-" + uuid.uuid4().hex[:12]
                    cred = uuid.uuid4().hex
                    self.credentials[node_id] = cred
                    self.command_keys[node_id] = secrets.token_hex(32)
                    self.node_ids.append(node_id)
                    self.enrolls.append(body)
                    answer = {
                        "node_id": node_id,
                        "credential": cred,
                        "redis_url": self.redis_url,
                        "heartbeat_interval": self.heartbeat_interval,
                        "state": "REGISTERING",
                        "protocol_version": PROTOCOL_VERSION,
                    }
                    if self.give_command_key:
                        answer["command_key"] = self.command_keys[node_id]
                    return 201, answer
                who = self._auth(auth)
                if not isinstance(who, str):
                    return who
                if path == "/api/agent/heartbeat":
                    self.heartbeats.append({"node_id": who, **body})
                    beat = {
                        "state": body.get("state", "READY"),
                        "heartbeat_interval": self.heartbeat_interval,
                        "protocol_version": PROTOCOL_VERSION,
                    }
                    if body.get("want_command_key") and self.give_command_key:
                        beat["command_key"] = self.command_keys[who]
                    return 200, beat
                if path == "/api/agent/reports":
                    kind_matches = self.fail_report_kind in (None, body.get("kind"))
                    if self.fail_reports > 0 and kind_matches:
                        self.fail_reports -= 1
                        self.rejected_reports += 1
                        return 503, {"error": "try later"}
                    self.reports.append({"node_id": who, **body})
                    return 202, {"accepted": True}
                return 404, {"error": "not found"}
            finally:
                self.cond.notify_all()

    # --- test helpers ---------------------------------------------------------------------------

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> Any:
        """Wait until predicate(self) is truthy; return its value or fail the test."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate(self)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {predicate}")
                self.cond.wait(min(left, 0.1))

    def results_for(self, command_id: str) -> list[dict[str, Any]]:
        return [
            r
            for r in self.reports
            if r["kind"] == "command_result" and r.get("command_id") == command_id
        ]

    def result(self, command_id: str, timeout: float = 40.0) -> dict[str, Any]:
        reports = self.wait_for(lambda c: c.results_for(command_id), timeout)
        return dict(reports[0]["payload"])

    def events(self, name: str) -> list[dict[str, Any]]:
        return [
            r["payload"]
            for r in self.reports
            if r["kind"] == "event" and r["payload"]["event"] == name
        ]

    def job_finished(self, job_id: str) -> list[dict[str, Any]]:
        return [
            r["payload"]
            for r in self.reports
            if r["kind"] == "job_finished" and r["payload"]["job_id"] == job_id
        ]


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


# --- Redis -----------------------------------------------------------------------------------------


@pytest.fixture
def redis_client() -> Iterator[Any]:
    redis = pytest.importorskip("redis")
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        r.ping()
    except redis.RedisError as exc:
        unavailable(f"Redis not reachable at {REDIS_URL}: {exc}")
    created: list[str] = []
    r.test_keys = created
    yield r
    # Only what this test made: its node's keys and its jobs' keys.
    for pattern in created:
        for key in r.scan_iter(match=pattern, count=500):
            r.delete(key)
    r.close()


@pytest.fixture
def node_id(redis_client: Any) -> str:
    nid = "test-" + uuid.uuid4().hex[:12]
    redis_client.test_keys.append(f"racon:n:{nid}:*")
    return nid


@pytest.fixture
def job_id(redis_client: Any) -> Iterator[str]:
    jid = "job-" + uuid.uuid4().hex[:12]
    redis_client.test_keys.append(f"racon:n:*:{jid}")
    yield jid


# --- fake controller -------------------------------------------------------------------------------


@pytest.fixture
def controller() -> Iterator[FakeController]:
    c = FakeController()
    yield c
    c.close()


@pytest.fixture
def h(controller: FakeController, redis_client: Any, tmp_path: Path) -> Iterator[Any]:
    """Runs real Agents in threads against the fake controller; stops them all afterwards."""
    harness = Harness(controller, redis_client, tmp_path)
    yield harness
    harness.close()
    for nid in controller.node_ids:
        redis_client.test_keys.append(f"racon:n:{nid}:*")
