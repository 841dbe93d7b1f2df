"""Runtimes: what actually serves ggml-rpc and runs a model. The Agent talks to them through
these small interfaces so unit tests can swap in the deterministic fake (agent.runtime.fake).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import redis

from agent.protocol import JobFinishedPayload, LoadPrimaryPayload, RunJobPayload

if TYPE_CHECKING:
    from agent.tunnel import TunnelTls

# (event name, human message, data) → reported to the controller as a kind="event" report.
EventSink = Callable[[str, str, dict[str, Any]], None]
JobFinishedSink = Callable[[JobFinishedPayload], None]


class RuntimeErrorReport(Exception):
    """A runtime refusal or failure with a message fit for the operator and an event name."""

    event = "RUNTIME_FAILED"

    def __init__(self, message: str, *, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.data = data or {}


class PortInUse(RuntimeErrorReport):
    event = "RPC_WORKER_FAILED"


class LoadFailed(RuntimeErrorReport):
    event = "RUNTIME_FAILED"


class RpcWorkerHandle(Protocol):
    endpoint: str

    def start(self) -> dict[str, Any]: ...

    def stop(self, timeout: float = 5.0) -> None: ...

    @property
    def running(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def authorize(
        self, deployment_id: str, key_hex: str, peer_host: str | None, tls: TunnelTls
    ) -> None: ...

    def allow_probes(self, probe_key: bytes) -> None:
        """Link probes with this node's probe key are answered from now on."""
        ...


class PrimaryHandle(Protocol):
    deployment_id: str

    def load(self) -> dict[str, Any]: ...

    def submit(self, job: RunJobPayload) -> None: ...

    def cancel(self, job_id: str) -> bool: ...

    def hand_off(self, job_id: str, message: str, *, code: str) -> bool: ...

    def jobs(self) -> list[str]: ...

    @property
    def alive(self) -> bool: ...

    def stop(self, timeout: float = 5.0) -> None: ...


class Runtime(Protocol):
    """Factory for the two runtime parts, plus the capability check behind READY."""

    name: str

    def check(self) -> tuple[bool, str]: ...

    def rpc_worker(
        self,
        *,
        host: str,
        port: int,
        cache_dir: Path,
        n_threads: int,
        log_path: Path,
        on_event: EventSink,
    ) -> RpcWorkerHandle: ...

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
    ) -> PrimaryHandle: ...
