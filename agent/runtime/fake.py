"""A deterministic fake runtime for unit tests only: fixed tokens, no llama.cpp, no child process.

It honours the same contracts as the real one (stream entries, cancel key, job_finished payloads,
public-address and port checks) so Agent tests exercise the Agent, not a mock of it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from agent.protocol import (
    JobFinishedPayload,
    LoadPrimaryPayload,
    PublicAddressError,
    RunJobPayload,
    StreamUsage,
    is_private_address,
)
from agent.runtime import EventSink, JobFinishedSink, LoadFailed, PortInUse, RuntimeErrorReport
from agent.runtime.rpc_worker import check_port_free, format_endpoint
from agent.runtime.stream import StreamWriter, append_error
from agent.tunnel import TunnelServer, TunnelTls

FAKE_TOKENS = ("Hello", " from", " the", " fake", " runtime", ".")


class FakeRpcWorker:
    """Holds a real RPC tunnel on the port (no ggml-rpc behind it), so port checks, link probes
    and tunnel authorization behave as with the real worker."""

    def __init__(self, *, host: str, port: int, on_event: EventSink) -> None:
        self.host, self.port = host, port
        self.endpoint = format_endpoint(host, port)
        self.on_event = on_event
        self._sock: TunnelServer | None = None
        self.probe_key: bytes | None = None

    @property
    def running(self) -> bool:
        return self._sock is not None

    def authorize(
        self, deployment_id: str, key_hex: str, peer_host: str | None, tls: TunnelTls
    ) -> None:
        if self._sock is None:
            raise ValueError("the RPC worker is not running behind its tunnel")
        self._sock.authorize(deployment_id, key_hex, peer_host, tls)

    def allow_probes(self, probe_key: bytes) -> None:
        self.probe_key = probe_key
        if self._sock is not None:
            self._sock.probe_key = probe_key

    def status(self) -> dict[str, Any]:
        return {"running": self.running, "endpoint": self.endpoint, "devices": [], "restarts": 0}

    def start(self) -> dict[str, Any]:
        if self._sock is not None:
            return self.status()
        if not is_private_address(self.host):
            exc = PublicAddressError(self.host)
            self.on_event(
                "PUBLIC_IP_VIOLATION", str(exc), {"address": self.host, "role": "rpc_worker"}
            )
            raise exc
        try:
            check_port_free(self.host, self.port)
        except PortInUse as exc:
            self.on_event("RPC_WORKER_FAILED", str(exc), {"endpoint": self.endpoint, **exc.data})
            raise
        s = TunnelServer(host=self.host, port=self.port, target_port=0, probe_key=self.probe_key)
        s.start()
        self._sock = s
        devices = [{"name": "CPU", "type": "cpu", "memory_total": 8 << 30, "memory_free": 6 << 30}]
        self.on_event(
            "RPC_WORKER_STARTED",
            f"ggml-rpc worker listening on {self.endpoint}",
            {
                "endpoint": self.endpoint,
                "devices": devices,
                "memory_total": 8 << 30,
                "memory_free": 6 << 30,
            },
        )
        return self.status()

    def stop(self, timeout: float = 5.0) -> None:
        if self._sock is not None:
            self._sock.stop()
            self._sock = None


class FakePrimary:
    def __init__(
        self,
        *,
        plan: LoadPrimaryPayload,
        node_id: str,
        redis_client: redis.Redis,
        on_event: EventSink,
        on_job_finished: JobFinishedSink,
        on_exit: Callable[[str], None],
        tokens: tuple[str, ...],
        token_delay: float,
        fail_load: str | None,
    ) -> None:
        self.node_id = node_id
        self.plan = plan
        self.deployment_id = plan["deployment_id"]
        self.r = redis_client
        self.on_event = on_event
        self.on_job_finished = on_job_finished
        self.on_exit = on_exit
        self.tokens = tokens
        self.token_delay = token_delay
        self.fail_load = fail_load
        self._alive = False
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._jobs: dict[str, threading.Event] = {}
        self._handoffs: dict[str, tuple[str, str]] = {}  # job id → hand_off's (message, code)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._crashed: str | None = None

    @property
    def alive(self) -> bool:
        return self._alive

    def load(self) -> dict[str, Any]:
        if self.fail_load:
            raise LoadFailed(
                f"deployment {self.deployment_id}: model load failed: {self.fail_load}"
            )
        self._alive = True
        self._thread = threading.Thread(target=self._serve, name="fake-primary", daemon=True)
        self._thread.start()
        endpoints = self.plan.get("rpc_endpoints", [])
        layers = list(range(30))
        per = max(1, len(layers) // (len(endpoints) + 1))
        assignment = []
        for i, ep in enumerate(endpoints):
            ls = layers[i * per : (i + 1) * per]
            assignment.append(
                {"device": f"RPC{i}", "endpoint": ep, "layers": ls, "n_layers": len(ls)}
            )
        rest = layers[len(endpoints) * per :]
        assignment.append(
            {"device": "CPU", "endpoint": None, "layers": rest, "n_layers": len(rest)}
        )
        return {
            "op": "loaded",
            "n_layer": 30,
            "assignment": assignment,
            "devices": [],
            "load_log": [],
        }

    def submit(self, job: RunJobPayload) -> None:
        if not self._alive:
            raise LoadFailed(f"deployment {self.deployment_id}: primary process is not running")
        with self._lock:
            self._jobs[job["job_id"]] = threading.Event()
        self._q.put(dict[str, Any](job))

    def cancel(self, job_id: str) -> bool:
        with self._lock:
            ev = self._jobs.get(job_id)
        if ev is not None:
            ev.set()
        return ev is not None

    def hand_off(self, job_id: str, message: str, *, code: str) -> bool:
        """As ServerPrimary.hand_off: the job's own writer ends its attempt with this error."""
        with self._lock:
            ev = self._jobs.get(job_id)
            if ev is None:
                return False
            self._handoffs[job_id] = (message, code)
        ev.set()
        return True

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            for ev in self._jobs.values():
                ev.set()
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self._alive = False

    def crash(self, reason: str = "RPC worker disconnected: fake crash") -> None:
        """Simulate the primary process dying mid-job (as when an RPC peer dies)."""
        self._crashed = reason
        with self._lock:
            for ev in self._jobs.values():
                ev.set()

    def _serve(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                cancel = self._jobs.get(job["job_id"]) or threading.Event()
            payload = self._run(job, cancel)
            with self._lock:
                self._jobs.pop(job["job_id"], None)
            if payload is not None:
                self.on_job_finished(payload)
            if self._crashed:
                self._die()
                return

    def _die(self) -> None:
        reason = self._crashed or "crash"
        self._alive = False
        with self._lock:
            pending = list(self._jobs)
            self._jobs.clear()
        while not self._q.empty():
            j = self._q.get_nowait()
            if j is not None and j["job_id"] not in pending:
                pending.append(j["job_id"])
        for jid in pending:
            append_error(self.r, jid, reason, node_id=self.node_id)
            self.on_job_finished(
                JobFinishedPayload(
                    job_id=jid, status="failed", prompt_tokens=0, completion_tokens=0, error=reason
                )
            )
        self.on_event(
            "RUNTIME_FAILED",
            f"deployment {self.deployment_id}: {reason}",
            {"deployment_id": self.deployment_id},
        )
        self.on_exit(self.deployment_id)

    def _run(self, job: dict[str, Any], cancel: threading.Event) -> JobFinishedPayload | None:
        job_id = job["job_id"]
        writer = StreamWriter(self.r, job_id, cancel, node_id=self.node_id)
        t0 = time.time()
        max_tokens = int(job.get("max_tokens") or 0) or len(self.tokens)
        n, finish = 0, "stop"
        first: float | None = None
        for tok in self.tokens:
            if cancel.is_set():
                finish = "cancelled"
                break
            if n >= max_tokens:
                finish = "length"
                break
            if self.token_delay:
                time.sleep(self.token_delay)
            writer.chunk(tok)
            first = first or time.time()
            n += 1
        if self._crashed:
            writer.close()
            append_error(self.r, job_id, self._crashed, node_id=self.node_id)
            return JobFinishedPayload(
                job_id=job_id,
                status="failed",
                prompt_tokens=3,
                completion_tokens=n,
                error=self._crashed,
            )
        ttft = round((first - t0) * 1000, 2) if first else None
        usage = StreamUsage(
            prompt_tokens=3,
            completion_tokens=n,
            total_tokens=3 + n,
            ttft_ms=ttft,
            tokens_per_s=None,
        )
        with self._lock:
            handoff = self._handoffs.pop(job_id, None)
        if handoff is not None and finish == "cancelled":
            writer.fail(handoff[0], usage, code=handoff[1])
            return JobFinishedPayload(
                job_id=job_id,
                status="failed",
                prompt_tokens=3,
                completion_tokens=n,
                error=handoff[0],
            )
        writer.done(finish, usage)
        return JobFinishedPayload(
            job_id=job_id,
            status="cancelled" if finish == "cancelled" else "completed",
            finish_reason=finish,
            prompt_tokens=3,
            completion_tokens=n,
            ttft_ms=ttft,
            tokens_per_s=None,
        )


class FakeRuntime:
    name = "fake"

    def __init__(
        self,
        *,
        tokens: tuple[str, ...] = FAKE_TOKENS,
        token_delay: float = 0.0,
        fail_load: str | None = None,
        supports_rpc: bool = True,
    ) -> None:
        self.tokens = tokens
        self.token_delay = token_delay
        self.fail_load = fail_load
        self.supports_rpc = supports_rpc
        self.primaries: list[FakePrimary] = []

    def check(self) -> tuple[bool, str]:
        if not self.supports_rpc:
            return False, "fake runtime: RPC support disabled"
        return True, "fake runtime"

    def rpc_worker(
        self,
        *,
        host: str,
        port: int,
        cache_dir: Path,
        n_threads: int,
        log_path: Path,
        on_event: EventSink,
    ) -> FakeRpcWorker:
        return FakeRpcWorker(host=host, port=port, on_event=on_event)

    def primary(
        self,
        *,
        plan: LoadPrimaryPayload,
        node_id: str,
        model_path: Path,
        redis_client: redis.Redis,
        redis_url: str,
        log_path: Path,
        on_event: EventSink,
        on_job_finished: JobFinishedSink,
        on_exit: Callable[[str], None],
    ) -> FakePrimary:
        p = FakePrimary(
            node_id=node_id,
            plan=plan,
            redis_client=redis_client,
            on_event=on_event,
            on_job_finished=on_job_finished,
            on_exit=on_exit,
            tokens=self.tokens,
            token_delay=self.token_delay,
            fail_load=self.fail_load,
        )
        self.primaries.append(p)
        return p


__all__ = ["FAKE_TOKENS", "FakeRuntime", "RuntimeErrorReport"]
