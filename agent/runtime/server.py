"""The primary runtime: one supervised `llama-server` per loaded plan (docs/design/serving.md).

llama.cpp's own server brings continuous batching over `n_parallel` slots, each with its own
sampling, stop strings, seed and cancellation. The agent drives its native `/completion` endpoint
(chat prompts come from `/apply-template`, the model's own template) with `return_tokens`, so
every chunk it relays carries the token ids it came from: the controller counts them, and
failover can continue from token ids rather than from text that does not re-tokenize reliably.

Only the agent talks to the server: it listens on 127.0.0.1 on a port picked here. Each job is
one HTTP request on a thread of its own; cancelling a job shuts that request's socket down, and
llama-server frees the slot between two decode steps. When an RPC peer dies the server aborts
(FACTS.md), like the old in-process primary did: this class notices the exit, ends every job in
flight with an error in its stream, and reports RUNTIME_FAILED.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import redis

from agent.layers import llama_layer_assignment
from agent.protocol import (
    SAMPLING_DEFAULTS,
    JobFinishedPayload,
    LoadPrimaryPayload,
    RunJobPayload,
    StreamUsage,
    job_cancel_key,
)
from agent.runtime import EventSink, JobFinishedSink, LoadFailed, RuntimeErrorReport
from agent.runtime.child import child_env, log_tail, stop_process
from agent.runtime.primary import (
    BUFFER_RE,
    LAYER_RE,
    N_LAYER_RE,
    RPC_CRASH_MARKERS,
    describe_exit,
    summarize_assignment,
)
from agent.runtime.prompting import template_request, token_probs
from agent.runtime.stream import (
    STREAM_COALESCE_BUSY_SECONDS,
    STREAM_COALESCE_BUSY_STREAMS,
    STREAM_COALESCE_SECONDS,
    DirectStreamWriter,
    EngineError,
    EventReader,
    append_error,
    last_seq,
)
from agent.runtime.template import RENDER_ERRORS, LocalTemplate, plain_messages
from agent.tunnel import TunnelClient, TunnelTls
from agent.tunnel import reachable as tunnel_reachable

log = logging.getLogger("agent.runtime.server")

# llama-server's stop_type → OpenAI's finish_reason.
FINISH = {"eos": "stop", "word": "stop", "limit": "length", "none": "stop"}
DEVICE_RE = re.compile(
    r"^\s*(RPC\d+|CPU\d*|CUDA\d+|Vulkan\d+|ROCm\d+|Metal\d*):\s*(.*?)(?:\s*\((\d+) MiB, (\d+) MiB free\))?\s*$"
)
CONTEXT_WORDS = ("exceeds the available context", "context size", "context length", "too long")


class ServerNotFound(LoadFailed):
    pass


def find_llama_server() -> Path:
    """The llama-server of this agent's llama.cpp build.

    RACON_LLAMA_SERVER names it explicitly; else the venv's `llama.cpp` link to the cached build
    (scripts/install-llama.sh), else PATH.
    """
    explicit = os.environ.get("RACON_LLAMA_SERVER")
    if explicit:
        return Path(explicit)
    venv_build = Path(sys.prefix) / "llama.cpp" / "bin" / "llama-server"
    if venv_build.is_file():
        return venv_build
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    raise ServerNotFound(
        "llama-server not found: run scripts/install-llama.sh (make install) or set RACON_LLAMA_SERVER"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(
    plan: LoadPrimaryPayload, model_path: Path, port: int, slot_save_path: Path | None = None
) -> list[str]:
    """llama-server's command line for a plan: each slot's context explicit (-c = n_ctx × -np);
    with ``slot_save_path``, slot save/restore on (the KV coordinator's state transfer)."""
    n_parallel = max(1, int(plan.get("n_parallel") or 1))
    n_ctx = int(plan.get("n_ctx") or 0) or 2048
    n_threads = int(plan.get("n_threads") or 0) or (os.cpu_count() or 1)
    args = [
        "-m", str(model_path),
        "--alias", plan["deployment_id"],  # names the process's deployment (ps, /proc)
        "--host", "127.0.0.1", "--port", str(port),
        "-np", str(n_parallel), "-c", str(n_ctx * n_parallel), "--no-kv-unified",
        "-t", str(n_threads), "-tb", str(n_threads),
        "-ngl", str(int(plan.get("n_gpu_layers", -1)) if int(plan.get("n_gpu_layers", -1)) >= 0 else 999),
        "-b", str(int(plan.get("n_batch") or 512)),
        "--jinja", "--no-webui", "--cont-batching",
        # Flash attention where the backend has it (measured here: +15% single-stream decode on
        # the CPU); it never needs more memory than the plain path the scheduler sized for.
        "-fa", "on" if plan.get("flash_attn") else "auto",
        # The scheduler sized memory for exactly this plan: no automatic refitting, and no host
        # prompt cache beyond the slots' own KV, which the plan did not count.
        "--fit", "off", "--cache-ram", "0",
        # Idle decode threads sleep instead of spinning: on a machine that also runs the agent's
        # relay (and often the controller), spinning steals the cores the relay needs per token
        # (bench/concurrency.py: single-stream ratio 0.80-0.83 with llama.cpp's default, 0.85-0.86 without).
        "--poll", "0",
        "--log-verbosity", "4",  # llama.cpp's info (buffers per device); layer lines are debug, with per-token noise
    ]  # fmt: skip
    if slot_save_path is not None:
        args += ["--slot-save-path", str(slot_save_path)]
    endpoints = list(plan.get("rpc_endpoints") or [])
    if endpoints:
        args += ["--rpc", ",".join(endpoints)]
    names = plan_device_names(plan)
    if names is not None:
        # Exactly the plan's devices, in its order (after --rpc, which names the RPC devices): a
        # GPU of this machine that the plan left out must not take layers, nor shift the split.
        args += ["--device", ",".join(names) or "none"]
    # The operator's extra engine flags (e.g. "--poll 0"), appended last so they win.
    args += shlex.split(os.environ.get("RACON_LLAMA_SERVER_ARGS", ""))
    split = [float(x) for x in plan.get("tensor_split") or []]
    if split and any(split):
        args += ["--tensor-split", ",".join(f"{x:g}" for x in split)]
    return args


class _Job:
    __slots__ = ("job", "cancel", "conn", "thread", "handoff")

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.cancel = threading.Event()
        self.conn: http.client.HTTPConnection | None = None
        self.thread: threading.Thread | None = None
        # Set by hand_off: the error (message, code) this attempt ends with instead of "cancelled".
        self.handoff: tuple[str, str] | None = None


class _Cancelled(Exception):
    pass


class _RequestError(Exception):
    def __init__(self, message: str, code: str = "runtime_error") -> None:
        super().__init__(message)
        self.code = code


class ServerPrimary:
    """One loaded plan served by llama-server. Thread-safe; job callbacks run on job threads."""

    ENGINE = "llama-server"  # names the engine in a failed request's error

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
        node_id: str,
        load_timeout: float = 600.0,
        server_path: Path | None = None,
    ) -> None:
        self.node_id = node_id
        self.plan = plan
        self.deployment_id = plan["deployment_id"]
        self.model_path = model_path
        self.r = redis_client
        self.log_path = log_path
        self.on_event = on_event
        self.on_job_finished = on_job_finished
        self.on_exit = on_exit
        self.load_timeout = load_timeout
        self.server_path = server_path
        self.n_parallel = max(1, int(plan.get("n_parallel") or 1))
        self.slot_ctx = int(plan.get("n_ctx") or 0) or 2048
        self.port = 0
        # llama-server's --api-key for this load, in its environment (never argv): another local
        # user of this machine cannot use the primary's engine.
        self.api_key = secrets.token_urlsafe(32)
        self.loaded: dict[str, Any] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._tunnels: list[TunnelClient] = []
        self._local_endpoints: dict[str, str] = {}  # tunnel client's 127.0.0.1 endpoint → worker
        # Whether the model's chat template renders tools itself (/props); else the agent does.
        self.template_has_tools = False
        # The chat template rendered here when it matches llama-server's (agent/runtime/template.py).
        self.local_template: LocalTemplate | None = None
        # llama-server's --slot-save-path: slot state files of a KV transfer pass through here.
        self.slot_dir: Path | None = None

    def _engine_plan(self) -> LoadPrimaryPayload:
        """The plan as llama-server sees it: workers behind their tunnels are local endpoints."""
        if not self._local_endpoints:
            return self.plan
        plan = dict(self.plan)
        plan["rpc_endpoints"] = list(self._local_endpoints)
        return plan  # type: ignore[return-value]  # the same TypedDict, one field rewritten

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def load(self) -> dict[str, Any]:
        """Start llama-server, wait until the model is loaded, warm it up. Raises LoadFailed."""
        t0 = time.perf_counter()
        exe = self.server_path or find_llama_server()
        for ep in self.plan.get("rpc_endpoints") or []:
            host, _, port = ep.rpartition(":")
            # ggml aborts the process on an unreachable worker; fail cleanly first. A worker
            # behind its tunnel is asked through the tunnel's probe mode (a bare connect that
            # says nothing would be logged there as a refused handshake).
            try:
                if self.plan.get("rpc_tunnel_key"):
                    tunnel_reachable(host.strip("[]"), int(port))
                else:
                    socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
            except (OSError, ConnectionError) as exc:
                raise LoadFailed(
                    f"deployment {self.deployment_id}: RPC worker {ep} is unreachable: {exc}",
                    data={"deployment_id": self.deployment_id},
                ) from None
        endpoints = list(self.plan.get("rpc_endpoints") or [])
        key = self.plan.get("rpc_tunnel_key")
        if key and endpoints:
            # llama-server dials 127.0.0.1 here; each TunnelClient does the worker's handshake.
            for ep in endpoints:
                host, _, port = ep.rpartition(":")
                client = TunnelClient(
                    remote_host=host.strip("[]"),
                    remote_port=int(port),
                    deployment_id=self.deployment_id,
                    key_hex=str(key),
                    tls=TunnelTls.from_wire(self.plan.get("rpc_tunnel_tls")),
                )
                self._tunnels.append(client)
                self._local_endpoints[client.local_endpoint] = ep
        self.port = free_port()
        self.slot_dir = Path(tempfile.mkdtemp(prefix=f"racon-kv-{self.deployment_id[:8]}-"))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        start_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as logf:
            self._proc = subprocess.Popen(
                die_with_parent(
                    [
                        str(exe),
                        *server_args(
                            self._engine_plan(), self.model_path, self.port, self.slot_dir
                        ),
                    ]
                ),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**child_env(), "LLAMA_API_KEY": self.api_key},
                close_fds=True,
            )
        deadline = time.monotonic() + self.load_timeout
        while True:
            if self._proc.poll() is not None:
                self._close_tunnels()
                raise LoadFailed(
                    f"deployment {self.deployment_id}: model load failed: {self._death_reason(self._proc.returncode)}",
                    data={"deployment_id": self.deployment_id, "exit_code": self._proc.returncode},
                )
            if self._health_ok():
                break
            if time.monotonic() > deadline:
                self._stopping.set()
                stop_process(self._proc, 2)
                self._close_tunnels()
                raise LoadFailed(
                    f"deployment {self.deployment_id}: model load timed out after "
                    f"{self.load_timeout:.0f}s (is an RPC worker busy serving another primary?)",
                    data={"deployment_id": self.deployment_id},
                )
            time.sleep(0.05)
        load_ms = round((time.perf_counter() - t0) * 1000, 1)
        warmup_ms = self._warm_up()
        props = self._props()
        self.template_has_tools = template_has_tools(props)
        self.local_template = LocalTemplate.verified(
            props, self._apply_template, name=f"deployment {self.deployment_id}"
        )
        report = self._load_report(start_offset)
        self._monitor = threading.Thread(
            target=self._watch, name=f"server-{self.deployment_id[:8]}", daemon=True
        )
        self._monitor.start()
        self.loaded = {
            "op": "loaded",
            "deployment_id": self.deployment_id,
            "pid": self._proc.pid,
            "load_ms": load_ms,
            "warmup_ms": warmup_ms,
            "n_parallel": self.n_parallel,
            "slot_ctx": self.slot_ctx,
            "engine": "llama-server",
            **report,
        }
        return self.loaded

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            jobs = list(self._jobs.values())
        for j in jobs:
            j.cancel.set()
            _shutdown(j.conn)
        proc = self._proc
        if proc is not None:
            stop_process(proc, timeout)
        self._close_tunnels()
        if self.slot_dir is not None:
            shutil.rmtree(self.slot_dir, ignore_errors=True)
        for j in jobs:
            if j.thread is not None and j.thread is not threading.current_thread():
                j.thread.join(timeout)

    # --- jobs ---------------------------------------------------------------------------------

    def submit(self, job: RunJobPayload) -> None:
        if not self.alive:
            raise LoadFailed(f"deployment {self.deployment_id}: primary process is not running")
        j = _Job(dict[str, Any](job))  # the runtime reads the job as the JSON it came as
        with self._lock:
            self._jobs[job["job_id"]] = j
        j.thread = threading.Thread(
            target=self._run, args=(j,), name=f"job-{job['job_id'][:8]}", daemon=True
        )
        j.thread.start()

    def cancel(self, job_id: str) -> bool:
        with self._lock:
            j = self._jobs.get(job_id)
        if j is None:
            return False
        j.cancel.set()
        _shutdown(j.conn)
        return True

    def hand_off(self, job_id: str, message: str, *, code: str) -> bool:
        """End a running job's attempt here with an error (``code``: a failover cause, such as
        node_paused), written by the job's own writer after what it streamed: one seq, the
        attempt's number. False when the job is not running here."""
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None:
                return False
            j.handoff = (message, code)
        j.cancel.set()
        _shutdown(j.conn)
        return True

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    # --- slot state (the KV coordinator's transfer) ---------------------------------------------

    def slot_file(self, filename: str) -> Path:
        """Where llama-server reads and writes ``filename`` (a bare name: llama-server refuses paths)."""
        if self.slot_dir is None:
            raise LoadFailed(f"deployment {self.deployment_id}: primary is not loaded")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", filename) or filename.startswith("."):
            raise ValueError(f"filename: {filename!r} is not a bare file name")
        return self.slot_dir / filename

    def slot_save(self, *, slot: int, filename: str, timeout: float = 120.0) -> dict[str, Any]:
        """Save one slot's tokens and KV cells to slot_file(filename) (llama-server waits for the
        slot to be idle). Returns llama-server's answer: n_saved tokens, n_written bytes."""
        return self._slot_action(slot, "save", filename, timeout)

    def slot_restore(self, *, slot: int, filename: str, timeout: float = 120.0) -> dict[str, Any]:
        """Load slot_file(filename) into one slot: its next request reuses the restored prompt
        (cache_prompt). Returns llama-server's answer: n_restored tokens, n_read bytes."""
        return self._slot_action(slot, "restore", filename, timeout)

    def _slot_action(self, slot: int, action: str, filename: str, timeout: float) -> dict[str, Any]:
        self.slot_file(filename)
        if not 0 <= int(slot) < self.n_parallel:
            raise ValueError(f"slot: {slot} is not a slot of this server (0-{self.n_parallel - 1})")
        if not self.alive:
            raise LoadFailed(f"deployment {self.deployment_id}: primary process is not running")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST",
                f"/slots/{int(slot)}?action={action}",
                json.dumps({"filename": filename}),
                self._headers(),
            )
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            err = _error_from(resp.status, data)
            raise RuntimeErrorReport(f"slot {action} of slot {slot} failed: {err}")
        out: dict[str, Any] = json.loads(data)
        return out

    # --- one job --------------------------------------------------------------------------------

    def _run(self, j: _Job) -> None:
        job = j.job
        job_id: str = job["job_id"]
        attempt = int(job.get("attempt") or 1)
        writer = DirectStreamWriter(self.r, job_id, j.cancel, node_id=self.node_id, attempt=attempt)
        received = float(job.get("_received_at") or time.time())
        first_chunk: float | None = None
        n_tokens = 0
        n_prompt = 0
        finish = "stop"
        error: _RequestError | None = None
        timings: dict[str, Any] = {}
        served_slot: int | None = None
        try:
            if self.r.exists(job_cancel_key(job_id, self.node_id)):
                raise _Cancelled
            prompt = self._prompt(j)
            max_tokens = int(job.get("max_tokens") or 0)
            body = _completion_body(job, prompt)
            if job.get("json_schema") is not None and job.get("resume_tokens"):
                # A resumed attempt under a grammar: the grammar starts where the output stands,
                # past the text of the tokens already streamed (llama-server feeds a
                # generation_prompt to an output-format grammar before sampling).
                resumed = self._post(j, "/detokenize", {"tokens": list(job["resume_tokens"])})
                body["generation_prompt"] = str(resumed.get("content") or "")
            top = int(job.get("top_logprobs") or 0)
            logprobs = bool(job.get("logprobs"))
            # Each batch is every event llama-server had sent when the agent read (coalesced
            # within STREAM_COALESCE_SECONDS): one stream entry for all its tokens, with each
            # token's share of the text (``lens``), so the controller can still cut on a token.
            for events in self._stream(j, body):
                if first_chunk is None:
                    # The first event carries the prompt's length: refuse, never truncate, a
                    # request that cannot fit the slot (before any of its tokens is relayed).
                    n_prompt = int(events[0].get("tokens_evaluated") or 0)
                    if max_tokens > 0 and n_prompt + max_tokens > self.slot_ctx:
                        raise _RequestError(
                            f"This model's context length is {self.slot_ctx} tokens per request, "
                            f"but {n_prompt + max_tokens} were requested ({n_prompt} in the "
                            f"prompt, {max_tokens} for the completion). Reduce the prompt or "
                            "max_tokens.",
                            code="context_length_exceeded",
                        )
                    first_chunk = time.time()
                texts: list[str] = []
                ids: list[int] = []
                lens: list[int] = []
                probs: list[dict[str, Any]] | None = [] if logprobs else None
                for event in events:
                    toks = event.get("tokens") or ()
                    text = event.get("content") or ""
                    if toks:
                        ids += toks
                        # An event's text belongs to its last token (earlier ones of the same
                        # event completed no character yet).
                        lens += [0] * (len(toks) - 1)
                        lens.append(len(text))
                    elif text and lens:
                        lens[-1] += len(text)  # text alone (a held stop-string prefix let go)
                    if text:
                        texts.append(text)
                    if probs is not None:
                        probs += token_probs(event.get("completion_probabilities") or [], top)
                    if event.get("id_slot") is not None:
                        served_slot = int(event["id_slot"])
                    if event.get("stop"):
                        finish = FINISH.get(str(event.get("stop_type") or "eos"), "stop")
                        timings = event.get("timings") or {}
                        n_prompt = int(event.get("tokens_evaluated") or n_prompt)
                if ids or texts:
                    n_tokens += len(ids)
                    writer.chunk("".join(texts), ids, probs, lens)
                if j.cancel.is_set():
                    raise _Cancelled
        except _Cancelled:
            finish, error = self._cancelled(j)
        except _RequestError as exc:
            error = exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            finish, error = self._broken_off(j, exc)
        tps = timings.get("predicted_per_second")
        ttft = round((first_chunk - received) * 1000, 2) if first_chunk is not None else None
        usage = StreamUsage(
            prompt_tokens=n_prompt,
            completion_tokens=n_tokens,
            total_tokens=n_prompt + n_tokens,
            ttft_ms=ttft,
            tokens_per_s=round(float(tps), 2) if tps else None,
        )
        if served_slot is not None and served_slot >= 0:
            usage["id_slot"] = served_slot
        if "prompt_n" in timings:
            # What the KV cache coordinator measures: prompt tokens prefilled vs. from the cache.
            usage["prompt_evaluated"] = int(timings.get("prompt_n") or 0)
            usage["prompt_cached"] = int(timings.get("cache_n") or 0)
        self._finish(j, writer, finish=finish, error=error, usage=usage)

    # --- what every engine's job thread shares (this one's, and agent/runtime/vllm.py's) ---------

    def _cancelled(self, j: _Job) -> tuple[str, _RequestError | None]:
        """A job that stopped on its cancel flag: cancelled, or handed off (hand_off's error)."""
        if j.handoff is not None:
            return "stop", _RequestError(j.handoff[0], code=j.handoff[1])
        return "cancelled", None

    def _broken_off(self, j: _Job, exc: Exception) -> tuple[str, _RequestError | None]:
        """A request to the engine that broke off: cancelled (the job's or the server's stop),
        the server's death (``__dead__``: the watcher's reason ends the job), or an error."""
        if j.cancel.is_set() or self._stopping.is_set():
            return self._cancelled(j)  # hand_off sets the flag before it breaks the connection
        if self._exited_within(2.0):
            # The server died (an RPC peer crashed, or it was killed): the watcher ends this
            # job with the process's death reason, once, in order after what was streamed.
            return "__dead__", None
        return "stop", _RequestError(f"{self.ENGINE} request failed: {type(exc).__name__}: {exc}")

    def _finish(
        self,
        j: _Job,
        writer: DirectStreamWriter,
        *,
        finish: str,
        error: _RequestError | None,
        usage: StreamUsage,
    ) -> None:
        """End a job's stream (done or error, with its usage) and report it finished."""
        job_id: str = j.job["job_id"]
        attempt = int(j.job.get("attempt") or 1)
        # Whoever takes the job out of the table ends it: this thread, or the watcher when the
        # server died or was stopped under it. Never both, so a stream gets exactly one end.
        with self._lock:
            claimed = self._jobs.pop(job_id, None) is not None
        if not claimed:
            writer.close()
            return
        if finish == "__dead__":
            writer.close()
            proc = self._proc
            self._end_with_error(
                job_id, self._death_reason(proc.returncode if proc else None), attempt=attempt
            )
            return
        if writer.error and error is None:
            error = _RequestError(writer.error)
        if error is not None:
            writer.fail(str(error), usage, code=error.code)
            status = "failed"
        else:
            writer.done(finish, usage)
            status = "cancelled" if finish == "cancelled" else "completed"
            if writer.error:
                # The end never reached the stream, so no follower can record it: the report
                # says so, and goes at once (agent/finished.py holds only completed ones).
                error, status = _RequestError(writer.error), "failed"
        payload = JobFinishedPayload(
            job_id=job_id,
            status=status,  # type: ignore[typeddict-item]  # one of the three literals, by the branches above
            finish_reason=None if status == "failed" else finish,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            ttft_ms=usage["ttft_ms"],
            tokens_per_s=usage["tokens_per_s"],
            attempt=attempt,
        )
        if error is not None:
            payload["error"] = str(error)
        self._safe(self.on_job_finished, payload)

    def _prompt(self, j: _Job) -> str | list[Any]:
        """The job's prompt for /completion: text (chat: the model's own template applied), then
        the token ids already generated by an earlier attempt, which never re-tokenize as text."""
        job = j.job
        if job.get("kind", "chat") == "chat":
            messages = job.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _RequestError(
                    "chat job needs a non-empty 'messages' list", code="invalid_request"
                )
            request = template_request(job, template_has_tools=self.template_has_tools)
            text = self._render_locally(request)
            if text is None:
                text = str(self._post(j, "/apply-template", request)["prompt"])
        else:
            prompt = job.get("prompt")
            if not isinstance(prompt, str):
                raise _RequestError(
                    "completion job needs a 'prompt' string", code="invalid_request"
                )
            text = prompt
        resume = [int(t) for t in job.get("resume_tokens") or []]
        return [text, *resume] if resume else text

    def _render_locally(self, request: dict[str, Any]) -> str | None:
        """The prompt from the verified local template, or None: no such template, messages it
        does not take (tools, structured content), or a template that refuses them (the server's
        /apply-template then answers, with its own error if it has one)."""
        plain = plain_messages(request) if self.local_template is not None else None
        if self.local_template is None or plain is None:
            return None
        try:
            return self.local_template.render(plain)
        except RENDER_ERRORS as exc:
            log.info("deployment %s: local template refused a job (%s)", self.deployment_id, exc)
            return None

    def _coalesce_window(self) -> float:
        """The relay's coalescing window for this primary's streams, asked at each batch: the
        busy one while it runs STREAM_COALESCE_BUSY_STREAMS jobs or more (agent/runtime/stream.py)."""
        busy = len(self._jobs) >= STREAM_COALESCE_BUSY_STREAMS
        return STREAM_COALESCE_BUSY_SECONDS if busy else STREAM_COALESCE_SECONDS

    def _connect(self, j: _Job) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=None)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        j.conn = conn
        if j.cancel.is_set():
            _shutdown(conn)
            raise _Cancelled
        return conn

    def _post(self, j: _Job, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = self._connect(j)
        try:
            conn.request("POST", path, json.dumps(body), self._headers())
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise _error_from(resp.status, data)
            out: dict[str, Any] = json.loads(data)
            return out
        finally:
            conn.close()

    def _stream(self, j: _Job, body: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
        """/completion's events, in batches of what had arrived (stream.EventReader)."""
        conn = self._connect(j)
        try:
            conn.request("POST", "/completion", json.dumps(body), self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise _error_from(resp.status, resp.read())
            reader = EventReader(resp, window=self._coalesce_window)
            while True:
                try:
                    events = reader.batch()
                except EngineError as exc:
                    raise _error_from(500, str(exc).encode()) from None
                if events is None:
                    if j.cancel.is_set():
                        raise _Cancelled
                    raise ConnectionError("llama-server closed the stream before its last event")
                for k, event in enumerate(events):
                    if "error" in event:
                        if k:
                            yield events[:k]
                        err = event["error"]
                        raise _error_from(int(err.get("code") or 500), json.dumps(event).encode())
                yield events
                if events[-1].get("stop"):
                    return
        finally:
            conn.close()

    def _close_tunnels(self) -> None:
        for t in self._tunnels:
            t.close()
        self._tunnels.clear()

    def _exited_within(self, timeout: float) -> bool:
        proc = self._proc
        if proc is None:
            return True
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    # --- load helpers ---------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"}

    def _health_ok(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/health", headers=self._headers())
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except (OSError, http.client.HTTPException):
            return False

    def _warm_up(self) -> float | None:
        """One tiny request so the first real one does not pay for paging weights in and building
        the batch graphs on every RPC worker (measured: ~0.9 s vs ~25 ms once warm)."""
        t0 = time.perf_counter()
        j = _Job({"job_id": "warm-up"})
        try:
            body = {"prompt": "Hi", "n_predict": 1, "temperature": 0.0, "cache_prompt": False}
            self._post(j, "/completion", body)
        except (OSError, http.client.HTTPException, ValueError, _RequestError) as exc:
            log.warning("deployment %s: warm-up skipped: %s", self.deployment_id, exc)
            return None
        return round((time.perf_counter() - t0) * 1000, 1)

    def _props(self) -> dict[str, Any]:
        """llama-server's /props ({} when unreadable: no tools in the template, no local template)."""
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            conn.request("GET", "/props", headers=self._headers())
            props = json.loads(conn.getresponse().read())
            conn.close()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.warning("deployment %s: /props unreadable: %s", self.deployment_id, exc)
            return {}
        return props if isinstance(props, dict) else {}

    def _apply_template(self, messages: list[dict[str, str]]) -> str | None:
        """The server's own rendering of a conversation (what a local template must match), or
        None when the server cannot give it."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            body = json.dumps({"messages": messages})
            conn.request("POST", "/apply-template", body, self._headers())
            resp = conn.getresponse()
            data = resp.read()
            return str(json.loads(data)["prompt"]) if resp.status == 200 else None
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            log.warning("deployment %s: /apply-template failed: %s", self.deployment_id, exc)
            return None
        finally:
            conn.close()

    def _load_report(self, offset: int) -> dict[str, Any]:
        """Where every layer and buffer went, read from the server's own load log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            text = ""
        layers: dict[int, str] = {}
        buffers: list[dict[str, Any]] = []
        lines: list[str] = []
        n_layer: int | None = None
        devices: list[dict[str, Any]] = []
        for local, remote in self._local_endpoints.items():
            text = text.replace(local, remote)  # the log names the tunnel's end; report the worker
        for raw in text.splitlines():
            line = raw.strip()
            if m := LAYER_RE.search(line):
                layers[int(m.group(1))] = m.group(2)
                lines.append(line)
            elif m := BUFFER_RE.search(line):
                buffers.append({"buffer": m.group(1), "kind": m.group(2), "mib": float(m.group(3))})
                lines.append(line)
            elif n_layer is None and (m := N_LAYER_RE.search(line)):
                n_layer = int(m.group(1))
        endpoints = list(self.plan.get("rpc_endpoints") or [])
        devices = [
            {"name": f"RPC{i}", "description": ep, "type": "gpu"} for i, ep in enumerate(endpoints)
        ]
        # The primary's own GPUs of the plan, by llama.cpp name (Vulkan0, CUDA0).
        for name in plan_device_names(self.plan) or []:
            if not name.startswith("RPC"):
                devices.append({"name": name, "description": name, "type": "gpu"})
        devices.append({"name": "CPU", "description": "CPU", "type": "cpu"})
        if not layers and n_layer is not None:
            layers = _replay_layers(n_layer, self.plan)
        return {
            "n_layer": n_layer,
            "n_ctx": self.slot_ctx,
            "devices": devices,
            "assignment": summarize_assignment(layers, devices, buffers),
            "layer_devices": {str(k): v for k, v in sorted(layers.items())},
            "load_log": lines,
        }

    # --- death ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        proc = self._proc
        assert proc is not None
        code = proc.wait()
        self._close_tunnels()
        if self._stopping.is_set():
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

    def _fail_jobs(self, reason: str, *, cancelled: bool) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        for j in jobs:
            j.cancel.set()
            _shutdown(j.conn)
            if j.thread is not None and j.thread is not threading.current_thread():
                j.thread.join(2.0)  # let its writer flush what it had before the end entry
            attempt = int(j.job.get("attempt") or 1)
            self._end_with_error(j.job["job_id"], reason, cancelled=cancelled, attempt=attempt)

    def _end_with_error(
        self, job_id: str, reason: str, *, cancelled: bool = False, attempt: int = 1
    ) -> None:
        """End a job whose server went away: the error after what it streamed, and the report.

        A death (not an unload) carries the code ``primary_died``: the controller moves the job
        to another replica, resuming from what was streamed (docs/design/serving.md, "Failover").
        """
        streamed = 0
        try:
            streamed = last_seq(self.r, job_id, self.node_id) + 1
            append_error(
                self.r,
                job_id,
                reason,
                node_id=self.node_id,
                attempt=attempt,
                code="" if cancelled else "primary_died",
            )
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
                attempt=attempt,
            ),
        )

    def _death_reason(self, code: int | None) -> str:
        tail = log_tail(self.log_path, 30)
        how = describe_exit(code)
        crash = next((ln for ln in reversed(tail) if any(m in ln for m in RPC_CRASH_MARKERS)), None)
        if crash is not None:
            said = next(crash[crash.index(m) :] for m in RPC_CRASH_MARKERS if m in crash).strip()
            return f"RPC worker disconnected: the primary process {how}; ggml-rpc: {said}"
        last = tail[-1].strip() if tail else "no output"
        if code in (134, -6):
            return f"the primary process {how}: {last}"
        return f"the primary process exited unexpectedly ({how}): {last}"

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("callback %r failed", fn)


def template_has_tools(props: dict[str, Any]) -> bool:
    """Whether the chat template renders tools itself (llama-server's /props caps)."""
    caps = props.get("chat_template_caps") or {}
    return bool(caps.get("supports_tools") and caps.get("supports_tool_calls"))


def _completion_body(job: Mapping[str, Any], prompt: str | list[Any]) -> dict[str, Any]:
    """/completion's body: the job's own sampling, every token id returned, the slot's prompt cache on."""
    max_tokens = int(job.get("max_tokens") or 0)
    body: dict[str, Any] = {
        "prompt": prompt,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": True,
        "n_predict": max_tokens if max_tokens > 0 else -1,
        "temperature": float(job.get("temperature", SAMPLING_DEFAULTS["temperature"])),
        "top_p": float(job.get("top_p", SAMPLING_DEFAULTS["top_p"])),
        "stop": list(job.get("stop") or []),
        "presence_penalty": float(
            job.get("presence_penalty", SAMPLING_DEFAULTS["presence_penalty"])
        ),
        "frequency_penalty": float(
            job.get("frequency_penalty", SAMPLING_DEFAULTS["frequency_penalty"])
        ),
    }
    if job.get("seed") is not None:
        body["seed"] = int(job["seed"])
    if job.get("json_schema") is not None:
        body["json_schema"] = job["json_schema"]
    if job.get("logprobs"):
        # At least one: the chosen token's own logprob comes with the alternatives.
        body["n_probs"] = max(1, int(job.get("top_logprobs") or 0))
    if job.get("id_slot") is not None and int(job["id_slot"]) >= 0:
        # The KV cache coordinator's pick: the slot that holds this conversation's prefix.
        body["id_slot"] = int(job["id_slot"])
    return body


def _error_from(status: int, data: bytes) -> _RequestError:
    try:
        obj = json.loads(data)
        err = obj.get("error", obj)
        message = str(err.get("message") or err)
    except (ValueError, AttributeError):
        message = data.decode("utf-8", errors="replace")[:500] or f"HTTP {status}"
    low = message.lower()
    if any(w in low for w in CONTEXT_WORDS):
        return _RequestError(message, code="context_length_exceeded")
    if status == 400:
        return _RequestError(message, code="invalid_request")
    return _RequestError(f"llama-server: {message}", code="runtime_error")


def _shutdown(conn: http.client.HTTPConnection | None) -> None:
    sock = conn.sock if conn is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def plan_device_names(plan: LoadPrimaryPayload) -> list[str] | None:
    """llama.cpp's offload devices for the plan, in tensor_split order, as the controller named
    them (RPC<k> for a worker's device, Vulkan0/CUDA0 for the primary's own); None from an older
    controller (the build's devices, as before)."""
    if "offload_devices" not in plan:
        return None
    return [str(d) for d in plan.get("offload_devices") or []]


def _replay_layers(n_layer: int, plan: LoadPrimaryPayload) -> dict[int, str]:
    """Each layer's device by llama.cpp's own rule (agent/layers.py); index n_layer is the output.
    llama-server logs the per-layer lines only at debug verbosity, which also logs every token."""
    endpoints = list(plan.get("rpc_endpoints") or [])
    split = [float(x) for x in plan.get("tensor_split") or []]
    named = plan_device_names(plan)
    names = (
        named
        if named is not None and len(named) == len(split)
        else [
            f"RPC{i}" if i < len(endpoints) else f"GPU{i - len(endpoints)}"
            for i in range(len(split))
        ]
    )
    ngl = int(plan.get("n_gpu_layers", -1))
    per_layer, output = llama_layer_assignment(n_layer, n_layer + 1 if ngl < 0 else ngl, split)
    return {
        il: "CPU" if d < 0 else names[min(d, len(names) - 1)]
        for il, d in enumerate([*per_layer, output])
    }


# Exec'd in front of llama-server: PR_SET_PDEATHSIG survives execve, so the server dies with the
# agent even when the agent is SIGKILLed. A plain exec, not Popen's preexec_fn, which is unsafe in
# a process with threads (the agent has many). The signal fires when the thread that forked
# exits; primaries are started from the agent's long-lived control thread.
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, 15) != 0:  # PR_SET_PDEATHSIG, SIGTERM\n"
    "    print('warning: PR_SET_PDEATHSIG failed (errno %d); llama-server will outlive a killed agent'"
    " % ctypes.get_errno(), file=sys.stderr, flush=True)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """argv, started through a tiny exec wrapper that ties the child's life to this process."""
    return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, *argv]
