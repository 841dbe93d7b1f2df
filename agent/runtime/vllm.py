"""The vLLM primary (issue 30): one supervised vLLM OpenAI server per loaded plan.

Like llama-server (agent/runtime/server.py), only the agent talks to it: it listens on 127.0.0.1
on a port picked here, with a per-load API key passed in its environment (VLLM_API_KEY, never
argv). vLLM runs from an engine venv of its own (scripts/install-vllm.sh: its pins clash with the
agent's), found through RACON_VLLM_PYTHON or the cached engine venv. Its CPU threads are capped
to the plan's n_threads (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND), or it stalls the other
engines on the machine.

A 200 from /health proves nothing (a GGUF model answers it, then dies at the first request:
FACTS.md), so the load is ready only after a one-token completion. Each job is one streamed
``/v1/completions`` request whose prompt is token ids (chat: the model's template applied by
vLLM's ``/tokenize``; a resumed attempt: those ids, then the tokens already streamed), with
``return_token_ids`` so every chunk relayed to Redis carries its token ids, like llama-server's.
The server runs in a process group of its own: stop() ends every child (vLLM's engine core), and
removes any shared-memory segment its processes had mapped that they left behind.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.protocol import (
    SAMPLING_DEFAULTS,
    LoadPrimaryPayload,
    StreamUsage,
    job_cancel_key,
    kv_held_key,
)
from agent.runtime import LoadFailed
from agent.runtime.child import child_env, log_tail
from agent.runtime.prompting import template_request
from agent.runtime.server import (
    ServerPrimary,
    _Cancelled,
    _error_from,
    _Job,
    _RequestError,
    die_with_parent,
    free_port,
)
from agent.runtime.stream import DirectStreamWriter

log = logging.getLogger("agent.runtime.vllm")

VLLM_VERSION = "0.32.0"
ENGINE_NAMES = ("llamacpp", "vllm")
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


def engine_python() -> Path | None:
    """The vLLM engine venv's python: RACON_VLLM_PYTHON, else the cached engine venv of
    scripts/install-vllm.sh (only once the install finished: its stamp file)."""
    explicit = os.environ.get("RACON_VLLM_PYTHON")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("RACON_CACHE") or Path.home() / ".cache" / "racon")
    for name in (f"vllm-{VLLM_VERSION}-py311", f"vllm-cuda-{VLLM_VERSION}"):
        venv = cache / "engines" / name
        if (venv / ".racon-vllm-ok").is_file() and (venv / "bin" / "python").exists():
            return venv / "bin" / "python"
    return None


def enabled_engines() -> list[str]:
    """The engines this node offers: RACON_ENGINES (default llamacpp), vllm only where its engine
    venv is installed."""
    wanted = [
        e.strip() for e in os.environ.get("RACON_ENGINES", "llamacpp").split(",") if e.strip()
    ]
    out = ["llamacpp"] if "llamacpp" in wanted or not wanted else []
    if "vllm" in wanted and engine_python() is not None:
        out.append("vllm")
    return out or ["llamacpp"]


def server_args(
    plan: LoadPrimaryPayload, model_dir: Path, port: int, kv_events: str | None = None
) -> list[str]:
    """vLLM's OpenAI server for a plan: eager (no compile at every start), float32 (exact tokens
    across runs on the CPU: FACTS.md), the plan's context and parallelism, nothing from a hub.
    ``kv_events``: the loopback endpoint its KV-cache events are published to (the agent's
    subscriber binds it; vLLM connects, so nothing of vLLM's listens for them)."""
    n_parallel = max(1, int(plan.get("n_parallel") or 1))
    n_ctx = int(plan.get("n_ctx") or 0) or 2048
    events = (
        [
            "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events}),
        ]
        if kv_events
        else []
    )
    return [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", plan["deployment_id"],
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(n_ctx),
        "--max-num-seqs", str(n_parallel),
        "--enforce-eager",
        "--dtype", os.environ.get("RACON_VLLM_DTYPE", "float32"),
        "--seed", "0",
        "--disable-uvicorn-access-log",
        "--enable-prefix-caching",
        # vLLM's CPU default is 128-token blocks: a chat turn's prefix is cached (and its KV
        # events published) per whole block, so smaller blocks let routing see short turns.
        "--block-size", os.environ.get("RACON_VLLM_BLOCK_SIZE", "32"),
        *events,
    ]  # fmt: skip


# The KV-event subscriber, run by the engine venv's python (it has zmq and msgspec): binds the
# loopback endpoint vLLM publishes to, and prints each batch as one JSON line the agent reads.
KV_SUBSCRIBER = r"""
import json, sys
import msgspec, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.bind(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
print(json.dumps({"bound": sys.argv[1]}), flush=True)
decode = msgspec.msgpack.Decoder().decode
def h(x):
    return x.hex() if isinstance(x, (bytes, bytearray)) else str(x)
while True:
    try:
        batch = decode(sub.recv_multipart()[-1])
    except Exception:
        continue
    out = []
    for e in (batch[1] if isinstance(batch, list) and len(batch) > 1 else []):
        kind = e.get("type") if isinstance(e, dict) else None
        if kind == "BlockStored":
            p = e.get("parent_block_hash")
            out.append({"t": "s", "h": [h(x) for x in e.get("block_hashes") or []],
                        "p": None if p is None else h(p), "ids": e.get("token_ids") or [],
                        "bs": int(e.get("block_size") or 16)})
        elif kind == "BlockRemoved":
            out.append({"t": "r", "h": [h(x) for x in e.get("block_hashes") or []]})
        elif kind == "AllBlocksCleared":
            out.append({"t": "c"})
    if out:
        print(json.dumps(out), flush=True)
"""


class KvBlocks:
    """vLLM's cached blocks as its KV events describe them: each block is its parent's hash and
    its tokens (a block's length comes with its event), so how much of a token sequence is
    cached is found by walking from the root, without knowing vLLM's hash function."""

    def __init__(self) -> None:
        self.block_size = 0
        self._blocks: dict[str, tuple[str | None, tuple[int, ...]]] = {}
        self._children: dict[str | None, dict[str, tuple[int, ...]]] = {}

    def apply(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e.get("t") == "c":
                self._blocks.clear()
                self._children.clear()
            elif e.get("t") == "r":
                for h in e.get("h") or []:
                    block = self._blocks.pop(str(h), None)
                    if block is not None:
                        self._children.get(block[0], {}).pop(str(h), None)
            elif e.get("t") == "s":
                hashes = [str(h) for h in e.get("h") or []]
                ids = [int(t) for t in e.get("ids") or []]
                if not hashes:
                    continue
                size = int(e.get("bs") or 0) or len(ids) // len(hashes)
                self.block_size = size
                parent = None if e.get("p") is None else str(e["p"])
                for i, h in enumerate(hashes):
                    tokens = tuple(ids[i * size : (i + 1) * size])
                    self._blocks[h] = (parent, tokens)
                    self._children.setdefault(parent, {})[h] = tokens
                    parent = h

    def cached_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` vLLM holds (whole blocks)."""
        parent: str | None = None
        n = 0
        while True:
            step = next(
                (
                    (h, len(t))
                    for h, t in self._children.get(parent, {}).items()
                    if t and tuple(tokens[n : n + len(t)]) == t
                ),
                None,
            )
            if step is None:
                return n
            parent, n = step[0], n + step[1]


def engine_env(plan: LoadPrimaryPayload, api_key: str) -> dict[str, str]:
    """vLLM's environment: the key (not argv), loopback, offline, threads capped to the plan's."""
    n_threads = int(plan.get("n_threads") or 0) or (os.cpu_count() or 1)
    env = child_env()
    env.pop("PYTHONPATH", None)  # the engine venv's own packages, not the agent's
    kv_gib = max(1, math.ceil(int(plan.get("kv_bytes") or 0) / 2**30))
    env.update(
        {
            "VLLM_API_KEY": api_key,
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "OMP_NUM_THREADS": str(n_threads),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("RACON_VLLM_THREADS_BIND")
            or _cpu_bind(n_threads),
            "VLLM_LOGGING_LEVEL": "INFO",
        }
    )
    return env


def _cpu_bind(n_threads: int) -> str:
    """The first n_threads CPUs this process may run on, as vLLM's bind list ("0-1" or "3")."""
    try:
        cpus = sorted(os.sched_getaffinity(0))[: max(1, n_threads)]
    except (AttributeError, OSError):
        cpus = list(range(max(1, n_threads)))
    return ",".join(str(c) for c in cpus)


def group_pids(pgid: int) -> list[int]:
    """Every live process of a process group (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def shm_segments(pids: list[int]) -> set[str]:
    """The /dev/shm files the given processes have mapped or open."""
    found: set[str] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    found.add(parts[5].split(" (deleted)")[0])
        except OSError:
            continue
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    found.add(target.split(" (deleted)")[0])
        except OSError:
            continue
    return found


class VllmPrimary(ServerPrimary):
    """One loaded plan served by vLLM's OpenAI server; jobs, cancel and death as ServerPrimary."""

    ENGINE = "vLLM"

    def __init__(self, *, python: Path | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.python = python
        self.shm: set[str] = set()
        self._pgid: int | None = None
        self.kv = KvBlocks()
        self._kv_proc: subprocess.Popen[bytes] | None = None
        self._slot_tokens: dict[int, list[int]] = {}  # each slot's last sequence (prompt + output)
        self._kv_lock = threading.Lock()

    def load(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        python = self.python or engine_python()
        if python is None:
            raise LoadFailed(
                f"deployment {self.deployment_id}: the vLLM engine is not installed on this node "
                "(scripts/install-vllm.sh, RACON_ENGINES=llamacpp,vllm)",
                data={"deployment_id": self.deployment_id},
            )
        if not (self.model_path / "config.json").is_file():
            raise LoadFailed(
                f"deployment {self.deployment_id}: {self.model_path} is not a model directory "
                "(no config.json); vLLM on the CPU cannot run GGUF files",
                data={"deployment_id": self.deployment_id},
            )
        self.template_has_tools = chat_template_knows_tools(self.model_path)
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        kv_endpoint = self._kv_subscribe(python)
        with open(self.log_path, "ab") as logf:
            self._proc = subprocess.Popen(
                die_with_parent(
                    [str(python), *server_args(self.plan, self.model_path, self.port, kv_endpoint)]
                ),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=engine_env(self.plan, self.api_key),
                close_fds=True,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        self._pgid = self._proc.pid
        deadline = time.monotonic() + self.load_timeout
        probe_ms: float | None = None
        while True:
            if self._proc.poll() is not None:
                self._kill_group()
                raise LoadFailed(
                    f"deployment {self.deployment_id}: vLLM failed to start: "
                    f"{self._death_reason(self._proc.returncode)}",
                    data={
                        "deployment_id": self.deployment_id,
                        "code": "engine_failed",
                        "exit_code": self._proc.returncode,
                        "log_tail": log_tail(self.log_path, 8),
                    },
                )
            if self._health_ok():
                # /health is no proof (FACTS.md): a real one-token completion is.
                probe_ms = self._warm_up()
                if probe_ms is not None:
                    break
            if time.monotonic() > deadline:
                self._stopping.set()
                self._kill_group()
                raise LoadFailed(
                    f"deployment {self.deployment_id}: vLLM did not answer a one-token probe "
                    f"within {self.load_timeout:.0f}s",
                    data={
                        "deployment_id": self.deployment_id,
                        "code": "engine_failed",
                        "log_tail": log_tail(self.log_path, 8),
                    },
                )
            time.sleep(0.5)
        self.shm = shm_segments(group_pids(self._pgid))
        self._monitor = threading.Thread(
            target=self._watch, name=f"vllm-{self.deployment_id[:8]}", daemon=True
        )
        self._monitor.start()
        self.loaded = {
            "op": "loaded",
            "deployment_id": self.deployment_id,
            "pid": self._proc.pid,
            "load_ms": round((time.perf_counter() - t0) * 1000, 1),
            "warmup_ms": probe_ms,
            "n_parallel": self.n_parallel,
            "slot_ctx": self.slot_ctx,
            "engine": "vllm",
            "n_layer": None,
            "n_ctx": self.slot_ctx,
            "devices": [{"name": "CPU", "description": "CPU", "type": "cpu"}],
            "assignment": [{"device": "CPU", "type": "cpu", "n_layers": 0}],
            "layer_devices": {},
            "load_log": [],
        }
        return self.loaded

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)
        self._kill_group(timeout)
        self._kv_stop()

    # --- KV-cache events (issue 30): a node's claim of what each slot still holds -------------------

    def _kv_subscribe(self, python: Path) -> str | None:
        """Start the subscriber on a loopback port; its endpoint for vLLM, or None without one."""
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        try:
            self._kv_proc = subprocess.Popen(
                die_with_parent([str(python), "-c", KV_SUBSCRIBER, endpoint]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={k: v for k, v in child_env().items() if k != "PYTHONPATH"},
                close_fds=True,
            )
        except OSError as exc:
            log.warning("deployment %s: no KV-event subscriber: %s", self.deployment_id, exc)
            return None
        threading.Thread(
            target=self._kv_read, name=f"vllm-kv-{self.deployment_id[:8]}", daemon=True
        ).start()
        return endpoint

    def _kv_read(self) -> None:
        proc = self._kv_proc
        if proc is None or proc.stdout is None:
            return
        for line in proc.stdout:
            try:
                events = json.loads(line)
            except ValueError:
                continue
            if isinstance(events, list):
                with self._kv_lock:
                    self.kv.apply(events)
                self._kv_publish()

    def _kv_remember(self, slot: Any, tokens: list[int]) -> None:
        if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0:
            with self._kv_lock:
                self._slot_tokens[slot] = tokens
            self._kv_publish()

    def _kv_publish(self) -> None:
        """What each slot's last sequence still has cached, by the events: the node's key."""
        with self._kv_lock:
            held = {str(s): self.kv.cached_tokens(t) for s, t in self._slot_tokens.items()}
        if not held:
            return
        try:
            self.r.set(kv_held_key(self.node_id, self.deployment_id), json.dumps(held), ex=3600)
        except Exception as exc:  # advice for routing; never a job's failure
            log.debug("deployment %s: KV claim not written: %s", self.deployment_id, exc)

    def _kv_stop(self) -> None:
        proc, self._kv_proc = self._kv_proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _kill_group(self, timeout: float = 5.0) -> None:
        """SIGTERM every process of the server's group, SIGKILL what remains, then unlink the
        shared-memory segments they had and left behind."""
        pgid = self._pgid
        if pgid is None:
            return
        pids = group_pids(pgid)
        self.shm |= shm_segments(pids)
        if pids:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            end = time.monotonic() + timeout
            while group_pids(pgid) and time.monotonic() < end:
                time.sleep(0.1)
            if group_pids(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                end = time.monotonic() + 5
                while group_pids(pgid) and time.monotonic() < end:
                    time.sleep(0.1)
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for path in self.shm:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._proc is not None and self._proc.poll() is not None:
            self._kv_stop()

    # --- requests -------------------------------------------------------------------------------

    def _health_ok(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except (OSError, http.client.HTTPException):
            return False

    def _warm_up(self) -> float | None:
        """The one-token probe: ready only when a completion comes back (ms), else None."""
        t0 = time.perf_counter()
        j = _Job({"job_id": "probe"})
        body = {"model": self.deployment_id, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0}
        try:
            out = self._post(j, "/v1/completions", body)
        except (OSError, http.client.HTTPException, ValueError, _RequestError) as exc:
            log.info("deployment %s: probe not answered yet: %s", self.deployment_id, exc)
            return None
        if not out.get("choices"):
            return None
        return round((time.perf_counter() - t0) * 1000, 1)

    def _prompt_ids(self, j: _Job) -> list[int]:
        """The job's prompt as token ids: chat through vLLM's /tokenize with the model's own
        template (tools as llama-server gets them: prompting.template_request), then the token
        ids an earlier attempt already streamed."""
        job = j.job
        if job.get("kind", "chat") == "chat":
            messages = job.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _RequestError(
                    "chat job needs a non-empty 'messages' list", code="invalid_request"
                )
            request = template_request(job, template_has_tools=self.template_has_tools)
            body: dict[str, Any] = {
                "model": self.deployment_id,
                "messages": request["messages"],
                "add_generation_prompt": True,
            }
            if request.get("tools"):
                body["tools"] = request["tools"]
        else:
            prompt = job.get("prompt")
            if not isinstance(prompt, str):
                raise _RequestError(
                    "completion job needs a 'prompt' string", code="invalid_request"
                )
            body = {"model": self.deployment_id, "prompt": prompt}
        ids = [int(t) for t in self._post(j, "/tokenize", body)["tokens"]]
        return ids + [int(t) for t in job.get("resume_tokens") or []]

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
        ids: list[int] = []
        generated: list[int] = []
        try:
            if self.r.exists(job_cancel_key(job_id, self.node_id)):
                raise _Cancelled
            if job.get("json_schema") is not None and job.get("resume_tokens"):
                # vLLM's structured outputs constrain an output from its first token: unlike
                # llama-server (generation_prompt), it has no way to start the grammar past the
                # text already streamed, so a constrained output cannot resume here.
                raise _RequestError(
                    "a schema-constrained output (response_format json_schema or a forced tool "
                    "call) cannot be resumed on a vLLM replica: vLLM's structured outputs "
                    "start the schema at the first token; resume it on a llama.cpp replica",
                    code="invalid_request",
                )
            ids = self._prompt_ids(j)
            n_prompt = len(ids)
            max_tokens = int(job.get("max_tokens") or 0)
            if max_tokens > 0 and n_prompt + max_tokens > self.slot_ctx:
                raise _RequestError(
                    f"This model's context length is {self.slot_ctx} tokens per request, "
                    f"but {n_prompt + max_tokens} were requested ({n_prompt} in the "
                    f"prompt, {max_tokens} for the completion). Reduce the prompt or "
                    "max_tokens.",
                    code="context_length_exceeded",
                )
            body = _completion_body(job, ids, self.deployment_id, self.slot_ctx - n_prompt)
            top = int(job.get("top_logprobs") or 0)
            for chunk in self._stream_v1(j, body):
                if chunk.get("usage"):
                    n_prompt = int(chunk["usage"].get("prompt_tokens") or n_prompt)
                for choice in chunk.get("choices") or []:
                    toks = [int(t) for t in choice.get("token_ids") or []]
                    text = str(choice.get("text") or "")
                    generated += toks
                    if toks or text:
                        if first_chunk is None:
                            first_chunk = time.time()
                        lens = [0] * (len(toks) - 1) + [len(text)] if toks else None
                        probs = _probs(choice.get("logprobs"), top) if job.get("logprobs") else None
                        n_tokens += len(toks)
                        writer.chunk(text, toks, probs, lens)
                    if choice.get("finish_reason"):
                        finish = FINISH.get(str(choice["finish_reason"]), "stop")
                if j.cancel.is_set():
                    raise _Cancelled
        except _Cancelled:
            finish, error = self._cancelled(j)
        except _RequestError as exc:
            error = exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            finish, error = self._broken_off(j, exc)
        if error is None and finish in ("stop", "length"):
            self._kv_remember(job.get("id_slot"), ids + generated)
        ttft = round((first_chunk - received) * 1000, 2) if first_chunk is not None else None
        elapsed = time.time() - first_chunk if first_chunk is not None else 0.0
        usage = StreamUsage(
            prompt_tokens=n_prompt,
            completion_tokens=n_tokens,
            total_tokens=n_prompt + n_tokens,
            ttft_ms=ttft,
            tokens_per_s=round(n_tokens / elapsed, 2) if elapsed > 0 and n_tokens > 1 else None,
        )
        self._finish(j, writer, finish=finish, error=error, usage=usage)

    def _stream_v1(self, j: _Job, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """vLLM's streamed /v1/completions, one parsed ``data:`` chunk at a time."""
        conn = self._connect(j)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise _vllm_error(resp.status, resp.read())
            while True:
                line = resp.readline()
                if not line:
                    if j.cancel.is_set():
                        raise _Cancelled
                    raise ConnectionError("vLLM closed the stream before [DONE]")
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    err = event["error"]
                    raise _vllm_error(int(err.get("code") or 500), json.dumps(event).encode())
                yield event
        finally:
            conn.close()

    def _death_reason(self, code: int | None) -> str:
        tail = log_tail(self.log_path, 30)
        last = next(
            (ln.strip() for ln in reversed(tail) if "Error" in ln or "error" in ln),
            tail[-1].strip() if tail else "no output",
        )
        return f"the vLLM server exited unexpectedly (exit {code}): {last}"


def _completion_body(job: dict[str, Any], ids: list[int], model: str, room: int) -> dict[str, Any]:
    max_tokens = int(job.get("max_tokens") or 0)
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "stream": True,
        "return_token_ids": True,
        "max_tokens": max_tokens if max_tokens > 0 else max(1, room),
        "temperature": float(job.get("temperature", SAMPLING_DEFAULTS["temperature"])),
        "top_p": float(job.get("top_p", SAMPLING_DEFAULTS["top_p"])),
        "stop": list(job.get("stop") or []),
        "presence_penalty": float(
            job.get("presence_penalty", SAMPLING_DEFAULTS["presence_penalty"])
        ),
        "frequency_penalty": float(
            job.get("frequency_penalty", SAMPLING_DEFAULTS["frequency_penalty"])
        ),
        "skip_special_tokens": True,
    }
    if job.get("seed") is not None:
        body["seed"] = int(job["seed"])
    if job.get("json_schema") is not None:
        # vLLM's structured outputs (guided decoding, xgrammar): the output matches the schema,
        # response_format's or a forced tool call's (apps/api/v1/agentic.py), as llama-server's
        # json_schema grammar does.
        body["structured_outputs"] = {"json": job["json_schema"]}
    if job.get("logprobs"):
        body["logprobs"] = max(1, int(job.get("top_logprobs") or 0))
    return body


def chat_template_knows_tools(model_dir: Path) -> bool:
    """Whether the model directory's chat template renders tools itself (it reads ``tools``), as
    llama-server's /props caps say for a GGUF. SmolLM2's does not: the agent then describes the
    tools in the system message (prompting.template_request)."""
    texts: list[str] = []
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        texts.append(jinja.read_text(errors="replace"))
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, str):
        texts.append(template)
    elif isinstance(template, list):
        texts += [str(t.get("template") or "") for t in template if isinstance(t, dict)]
    return any("tools" in t for t in texts)


def _probs(lp: dict[str, Any] | None, top: int) -> list[dict[str, Any]]:
    """vLLM's completions logprobs (tokens, token_logprobs, top_logprobs) as OpenAI's content."""
    if not lp:
        return []
    out = []
    tops = lp.get("top_logprobs") or []
    for i, tok in enumerate(lp.get("tokens") or []):
        alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        out.append(
            {
                "token": tok,
                "logprob": float((lp.get("token_logprobs") or [0.0])[i] or 0.0),
                "bytes": list(str(tok).encode()),
                "top_logprobs": [
                    {"token": t, "logprob": float(v), "bytes": list(str(t).encode())}
                    for t, v in sorted(alts.items(), key=lambda kv: -kv[1])[:top]
                ],
            }
        )
    return out


def _vllm_error(status: int, data: bytes) -> _RequestError:
    err = _error_from(status, data)
    if err.code == "runtime_error":
        return _RequestError(str(err).replace("llama-server:", "vLLM:", 1), code=err.code)
    return err


def make_primary(python: Path | None = None, **kw: Any) -> VllmPrimary:
    return VllmPrimary(python=python, **kw)


__all__ = [
    "ENGINE_NAMES",
    "VllmPrimary",
    "chat_template_knows_tools",
    "enabled_engines",
    "engine_python",
    "make_primary",
]
