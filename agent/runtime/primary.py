"""The llama.cpp primary, agent side: plan checks, and one supervised child process per plan.

Why a child: the ggml backend registry is process-wide and cannot be undone (a new plan needs a
new process), and when an RPC peer dies llama.cpp aborts the whole process (exit 134). The agent
must survive that, end the running job's stream with an error, and report.

Agent → child: JSON lines on the child's stdin ({"op": "run_job" | "cancel" | "shutdown"}).
Child → agent: JSON lines on a dedicated pipe (stdout/stderr go to the log file, and C code
writes there too, so they cannot carry messages).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import redis

from agent.protocol import (
    JobFinishedPayload,
    LoadPrimaryPayload,
    PublicAddressError,
    is_private_address,
    split_endpoint,
)
from agent.runtime import EventSink, JobFinishedSink, LoadFailed
from agent.runtime.child import log_tail, spawn, stop_process
from agent.runtime.stream import append_error, last_seq

log = logging.getLogger("agent.runtime.primary")

RPC_CRASH_MARKERS = ("Remote RPC server crashed", "Failed to connect to", "RPC handshake failed")
MAX_DEVICES = 16  # llama.cpp's LLAMA_MAX_DEVICES


class PlanError(ValueError):
    """A load_primary plan this node refuses; the message says why, for the operator."""


def validate_plan_shape(payload: dict[str, Any]) -> LoadPrimaryPayload:
    """Types and ranges of a load_primary payload. Raises PlanError / PublicAddressError."""

    def need(key: str, types: type | tuple[type, ...]) -> Any:
        if key not in payload:
            raise PlanError(f"malformed load_primary: missing {key!r}")
        value = payload[key]
        if not isinstance(value, types) or isinstance(value, bool) and types is not bool:
            raise PlanError(f"malformed load_primary: {key!r} has the wrong type")
        return value

    need("deployment_id", str)
    need("model_name", str)
    sha = need("sha256", str)
    if len(sha) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha):
        raise PlanError("malformed load_primary: 'sha256' must be 64 hex digits")
    endpoints = need("rpc_endpoints", list)
    split = need("tensor_split", list)
    need("n_gpu_layers", int)
    n_ctx = need("n_ctx", int)
    need("n_parallel", int)
    n_threads = need("n_threads", int)
    if n_ctx < 0 or n_threads < 0:
        raise PlanError("malformed load_primary: n_ctx and n_threads must be >= 0")
    for ep in endpoints:
        if not isinstance(ep, str):
            raise PlanError("malformed load_primary: rpc_endpoints must be 'host:port' strings")
        try:
            host, _ = split_endpoint(ep)
        except ValueError as exc:
            raise PlanError(f"malformed load_primary: {exc}") from None
        if not is_private_address(host):
            raise PublicAddressError(host)
    if len(endpoints) > MAX_DEVICES - 1:
        raise PlanError(
            f"plan names {len(endpoints)} RPC workers; llama.cpp allows {MAX_DEVICES - 1}"
        )
    for v in split:
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise PlanError("malformed load_primary: tensor_split entries must be numbers >= 0")
    if len(split) > MAX_DEVICES:
        raise PlanError(f"tensor_split has {len(split)} entries; llama.cpp allows {MAX_DEVICES}")
    mem = payload.get("memory_bytes")
    if mem is not None and (not isinstance(mem, int) or isinstance(mem, bool) or mem < 0):
        raise PlanError("malformed load_primary: 'memory_bytes' must be an integer >= 0")
    mp = payload.get("model_path")
    if mp is not None and not isinstance(mp, str):
        raise PlanError("malformed load_primary: 'model_path' must be a string")
    return payload  # type: ignore[return-value]


def check_memory(plan: LoadPrimaryPayload, memory_total: int) -> None:
    need = plan.get("memory_bytes")
    if need is not None and memory_total > 0 and need > memory_total:
        raise PlanError(
            f"plan needs {need / 2**30:.2f} GiB on the primary but this machine has "
            f"{memory_total / 2**30:.2f} GiB of RAM; refusing to load"
        )


class PrimaryProcess:
    """One loaded plan. Thread-safe; callbacks run on its reader thread."""

    def __init__(
        self,
        *,
        plan: LoadPrimaryPayload,
        model_path: Path,
        redis_client: redis.Redis,
        redis_url: str,
        log_path: Path,
        on_event: EventSink,
        on_job_finished: JobFinishedSink,
        on_exit: Callable[[str], None],
        load_timeout: float = 600.0,
    ) -> None:
        self.plan = plan
        self.deployment_id = plan["deployment_id"]
        self.model_path = model_path
        self.r = redis_client
        self.redis_url = redis_url
        self.log_path = log_path
        self.on_event = on_event
        self.on_job_finished = on_job_finished
        self.on_exit = on_exit
        self.load_timeout = load_timeout
        self.loaded: dict[str, Any] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._msg: IO[str] | None = None
        self._lock = threading.Lock()  # guards _jobs, _running, stdin writes
        self._jobs: dict[str, dict[str, Any]] = {}  # submitted, not finished, in order
        self._running: str | None = None
        self._loaded_evt = threading.Event()
        self._load_result: dict[str, Any] = {}
        self._stopping = threading.Event()
        self._reader: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def load(self) -> dict[str, Any]:
        """Start the child and wait for the model to be loaded. Raises LoadFailed."""
        proc, msg = spawn(
            "agent.runtime.primary_main",
            [
                "--plan",
                json.dumps(self.plan),
                "--model-path",
                str(self.model_path),
                "--redis-url",
                self.redis_url,
            ],
            log_path=self.log_path,
            with_stdin=True,
        )
        self._proc, self._msg = proc, msg
        self._reader = threading.Thread(
            target=self._read, name=f"primary-{self.deployment_id[:8]}", daemon=True
        )
        self._reader.start()
        if not self._loaded_evt.wait(self.load_timeout):
            self._stopping.set()  # a failed load is reported by load(), not as a runtime crash
            stop_process(proc, 2)
            raise LoadFailed(
                f"deployment {self.deployment_id}: model load timed out after "
                f"{self.load_timeout:.0f}s (is an RPC worker busy serving another primary?)",
                data={"deployment_id": self.deployment_id},
            )
        result = self._load_result
        if result.get("op") != "loaded":
            self._stopping.set()  # a failed load is reported by load(), not as a runtime crash
            stop_process(proc, 2)
            error = result.get("error") or self._death_reason(proc.returncode)
            raise LoadFailed(
                f"deployment {self.deployment_id}: model load failed: {error}",
                data={"deployment_id": self.deployment_id, "exit_code": proc.returncode},
            )
        self.loaded = result
        return result

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is None:
            return
        self._send({"op": "shutdown"})
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc, 2)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)

    # --- jobs ---------------------------------------------------------------------------------

    def submit(self, job: dict[str, Any]) -> None:
        with self._lock:
            self._jobs[job["job_id"]] = job
        if not self._send({"op": "run_job", "job": job}):
            raise LoadFailed(f"deployment {self.deployment_id}: primary process is not running")

    def cancel(self, job_id: str) -> bool:
        with self._lock:
            known = job_id in self._jobs
        if known:
            self._send({"op": "cancel", "job_id": job_id})
        return known

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def running_job(self) -> str | None:
        return self._running

    # --- internals ----------------------------------------------------------------------------

    def _send(self, obj: dict[str, Any]) -> bool:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            return False
        data = (json.dumps(obj) + "\n").encode()
        with self._lock:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                return False
        return True

    def _read(self) -> None:
        assert self._msg is not None
        for line in self._msg:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            op = msg.get("op")
            if op in ("loaded", "load_failed"):
                self._load_result = msg
                self._loaded_evt.set()
            elif op == "job_started":
                self._running = msg.get("job_id")
            elif op == "job_finished":
                payload: JobFinishedPayload = msg["payload"]
                with self._lock:
                    self._jobs.pop(payload["job_id"], None)
                    if self._running == payload["job_id"]:
                        self._running = None
                self._safe(self.on_job_finished, payload)
        # EOF: the child is gone.
        proc = self._proc
        code = proc.wait() if proc is not None else None
        self._msg.close()
        if not self._loaded_evt.is_set():
            self._loaded_evt.set()  # load() reads the death from the exit code
            return
        if self._stopping.is_set():  # we stopped it (unload, drain, failed load): not a crash
            self._fail_jobs("primary runtime stopped (deployment unloaded)", cancelled=True)
            return
        reason = self._death_reason(code)
        log.error("deployment %s: %s", self.deployment_id, reason)
        self._fail_jobs(reason, cancelled=False)
        self._safe(
            self.on_event,
            "RUNTIME_FAILED",
            f"deployment {self.deployment_id}: {reason}",
            {
                "deployment_id": self.deployment_id,
                "exit_code": code,
                "log_tail": log_tail(self.log_path, 8),
            },
        )
        self._safe(self.on_exit, self.deployment_id)

    def _death_reason(self, code: int | None) -> str:
        tail = log_tail(self.log_path, 30)
        how = _describe_exit(code)
        crash = next((ln for ln in reversed(tail) if any(m in ln for m in RPC_CRASH_MARKERS)), None)
        if crash is not None:
            # ggml prefixes its source path ("/tmp/.../ggml-rpc.cpp:35: ..."); keep the words.
            said = next(crash[crash.index(m) :] for m in RPC_CRASH_MARKERS if m in crash).strip()
            return f"RPC worker disconnected: the primary process {how}; ggml-rpc: {said}"
        last = tail[-1].strip() if tail else "no output"
        if code in (134, -6):
            return f"the primary process {how}: {last}"
        return f"the primary process exited unexpectedly ({how}): {last}"

    def _fail_jobs(self, reason: str, *, cancelled: bool) -> None:
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
            self._running = None
        for job_id in jobs:
            streamed = 0
            try:
                # Chunks already streamed are the tokens this job got before the failure.
                streamed = last_seq(self.r, job_id) + 1
                append_error(self.r, job_id, reason)
            except redis.RedisError as exc:
                log.error("job %s: cannot write the error to its stream: %s", job_id, exc)
            self._safe(
                self.on_job_finished,
                JobFinishedPayload(
                    job_id=job_id,
                    status="cancelled" if cancelled else "failed",
                    finish_reason=None,
                    prompt_tokens=0,
                    completion_tokens=streamed,
                    error=reason,
                ),
            )

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("callback %r failed", fn)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "vanished"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "aborted (SIGABRT)" if code == -6 else f"was killed by {name}"
    if code == 134:
        return "aborted (exit 134)"
    return f"exited with code {code}"
