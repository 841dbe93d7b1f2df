"""Child process: one llama.cpp primary for one plan. Started by agent.runtime.primary.

    python -m agent.runtime.primary_main --plan JSON --model-path P --redis-url URL --msg-fd N

Registers the plan's RPC workers (before the model loads: the order of registration is the order
of tensor_split), loads the GGUF, then runs jobs one at a time from stdin, appending chunks to each
job's Redis stream. Messages to the agent go to --msg-fd as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import socket
import sys
import threading
import time
from typing import Any, TextIO

from agent.protocol import (
    JobFinishedPayload,
    StreamUsage,
    job_cancel_key,
    split_endpoint,
)
from agent.runtime.child import watch_parent

LAYER_RE = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
BUFFER_RE = re.compile(r"(\S+) (model|KV|compute) buffer size =\s*([\d.]+) MiB")
N_LAYER_RE = re.compile(r"n_layer\s*=\s*(\d+)")


class JobCancelled(Exception):
    pass


class LoadLogCapture:
    """Tees llama-cpp-python's verbose log (printed to sys.stderr) and keeps the placement lines."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner
        self.layers: dict[int, str] = {}
        self.buffers: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self.n_layer: int | None = None
        self._partial = ""

    def write(self, text: str) -> int:
        self.inner.write(text)
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            self._line(line)
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def _line(self, line: str) -> None:
        if m := LAYER_RE.search(line):
            self.layers[int(m.group(1))] = m.group(2)
            self.lines.append(line.strip())
        elif m := BUFFER_RE.search(line):
            self.buffers.append(
                {"buffer": m.group(1), "kind": m.group(2), "mib": float(m.group(3))}
            )
            self.lines.append(line.strip())
        elif self.n_layer is None and (m := N_LAYER_RE.search(line)):
            self.n_layer = int(m.group(1))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def buffer_device(buffer: str, devices: list[dict[str, Any]]) -> str:
    """The device a buffer belongs to.

    RPC buffer names carry the server-local device index and the endpoint ("RPC0[10.0.0.5:50052]"
    for the first device of *every* server), while device names are numbered across servers
    (RPC0, RPC1, ...); match by endpoint, then by position within that server.
    """
    name, _, rest = buffer.partition("[")
    if not rest or not name.startswith("RPC"):
        return "CPU" if name.startswith("CPU") else name
    endpoint = rest.rstrip("]")
    local = int(name[3:]) if name[3:].isdigit() else 0
    same_server = [d["name"] for d in devices if d.get("description") == endpoint]
    return same_server[local] if local < len(same_server) else name


def summarize_assignment(
    layers: dict[int, str], devices: list[dict[str, Any]], buffers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per device: which layers it holds, and its model/KV/compute buffers (MiB)."""
    by_dev: dict[str, list[int]] = {}
    for layer, dev in sorted(layers.items()):
        by_dev.setdefault(dev, []).append(layer)
    desc = {d["name"]: d for d in devices}
    out: list[dict[str, Any]] = []
    for dev, ls in by_dev.items():
        info = desc.get(dev, {})
        entry: dict[str, Any] = {
            "device": dev,
            "description": info.get("description", ""),
            # RPC device descriptions are the worker endpoint ("host:port").
            "endpoint": info.get("description") if dev.startswith("RPC") else None,
            "layers": ls,
            "first_layer": ls[0],
            "last_layer": ls[-1],
            "n_layers": len(ls),
        }
        for b in buffers:
            if buffer_device(b["buffer"], devices) == dev:
                key = f"{b['kind'].lower()}_buffer_mib"
                entry[key] = round(entry.get(key, 0.0) + b["mib"], 2)
        out.append(entry)
    return out


class Child:
    def __init__(self, args: argparse.Namespace) -> None:
        self.plan: dict[str, Any] = json.loads(args.plan)
        self.model_path: str = args.model_path
        self.msg = os.fdopen(args.msg_fd, "w", buffering=1)
        self._msg_lock = threading.Lock()
        self.jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        import redis

        self.r = redis.Redis.from_url(args.redis_url, decode_responses=True)
        self.llm: Any = None

    def send(self, obj: dict[str, Any]) -> None:
        with self._msg_lock:
            self.msg.write(json.dumps(obj) + "\n")
            self.msg.flush()

    # --- stdin ----------------------------------------------------------------------------------

    def read_stdin(self) -> None:
        for line in sys.stdin:
            try:
                m = json.loads(line)
            except ValueError:
                continue
            op = m.get("op")
            if op == "run_job":
                job = m["job"]
                job.setdefault("_received_at", time.time())
                with self._lock:
                    self.cancels[job["job_id"]] = threading.Event()
                self.jobs.put(job)
            elif op == "cancel":
                with self._lock:
                    ev = self.cancels.get(m.get("job_id", ""))
                if ev is not None:
                    ev.set()
            elif op == "shutdown":
                break
        # Shutdown or EOF (the agent is gone): stop the current job at the next token.
        with self._lock:
            for ev in self.cancels.values():
                ev.set()
        self.jobs.put(None)

    # --- load -----------------------------------------------------------------------------------

    def load(self) -> None:
        t0 = time.perf_counter()
        capture = LoadLogCapture(sys.stderr)
        sys.stderr = capture  # llama-cpp-python's log callback prints to sys.stderr at call time
        try:
            from agent.runtime.ggml import Ggml

            endpoints = list(self.plan.get("rpc_endpoints", []))
            ggml = Ggml()
            for ep in endpoints:
                host, port = split_endpoint(ep)
                # ggml aborts the process on an unreachable worker; fail cleanly first.
                try:
                    socket.create_connection((host, port), timeout=5).close()
                except OSError as exc:
                    raise RuntimeError(f"RPC worker {ep} is unreachable: {exc}") from None
                ggml.add_rpc_server(ep)
            import llama_cpp

            if endpoints and not llama_cpp.llama_supports_rpc():
                raise RuntimeError("this llama-cpp-python has no RPC support")
            devices = [d.as_dict() for d in ggml.devices()]
            split = [float(x) for x in self.plan.get("tensor_split", [])]
            n_threads = int(self.plan.get("n_threads") or 0) or (os.cpu_count() or 1)
            self.llm = llama_cpp.Llama(
                model_path=self.model_path,
                n_gpu_layers=int(self.plan.get("n_gpu_layers", -1)),
                tensor_split=split or None,
                n_ctx=int(self.plan.get("n_ctx") or 0),
                n_threads=n_threads,
                n_threads_batch=n_threads,
                # The scheduler sized the compute buffers for these; keep them in step.
                n_batch=int(self.plan.get("n_batch") or 512),
                flash_attn=bool(self.plan.get("flash_attn", False)),
                verbose=True,
            )
        except Exception as exc:
            sys.stderr = capture.inner
            self.send({"op": "load_failed", "error": f"{type(exc).__name__}: {exc}"})
            raise SystemExit(5) from None
        finally:
            sys.stderr = capture.inner
        # Quiet from here on: per-job timing prints would cost time on every request.
        self.llm.verbose = False
        try:
            from llama_cpp import _logger

            _logger.set_verbose(False)
        except ImportError:
            pass
        warmup_ms = self.warm_up()
        assignment = summarize_assignment(capture.layers, devices, capture.buffers)
        self.send(
            {
                "op": "loaded",
                "deployment_id": self.plan.get("deployment_id"),
                "pid": os.getpid(),
                "load_ms": round((time.perf_counter() - t0) * 1000, 1),
                "warmup_ms": warmup_ms,
                "n_layer": capture.n_layer,
                "n_ctx": int(self.llm.n_ctx()),
                "devices": devices,
                "assignment": assignment,
                "layer_devices": {str(k): v for k, v in sorted(capture.layers.items())},
                "load_log": capture.lines,
            }
        )

    def warm_up(self) -> float | None:
        """Run one tiny request so the first real one does not pay for paging weights in,
        starting threads and compiling the template (measured: ~0.9 s vs ~25 ms once warm)."""
        t0 = time.perf_counter()
        try:
            # A real (tiny) chat request: also compiles the chat template and builds the
            # batch-sized graphs on every RPC worker, not just the one-token decode graph.
            self.llm.create_chat_completion(
                messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0.0
            )
            self.llm.reset()
        except Exception as exc:  # a warm-up failure is not a load failure
            print(f"warm-up skipped: {exc}", file=sys.stderr)
            return None
        return round((time.perf_counter() - t0) * 1000, 1)

    # --- jobs -----------------------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self._lock:
                cancel = self.cancels.get(job["job_id"]) or threading.Event()
            try:
                payload = self.run_job(job, cancel)
            finally:
                with self._lock:
                    self.cancels.pop(job["job_id"], None)
            self.send({"op": "job_finished", "payload": payload})

    def run_job(self, job: dict[str, Any], cancel: threading.Event) -> JobFinishedPayload:
        from agent.runtime.stream import StreamWriter

        job_id: str = job["job_id"]
        self.send({"op": "job_started", "job_id": job_id})
        llm = self.llm
        writer = StreamWriter(self.r, job_id, cancel)
        received = float(job.get("_received_at") or time.time())
        st: dict[str, Any] = {"prompt": None, "n": 0, "eog": 0, "t_first": None, "t_last": None}
        first_chunk: float | None = None
        finish: str | None = None
        error: str | None = None
        orig_sample = llm.sample

        def sample(*a: Any, **kw: Any) -> int:
            # Called once per generated token: the cheapest place to stop "within one token".
            if cancel.is_set():
                raise JobCancelled
            if st["prompt"] is None:
                st["prompt"] = int(llm.n_tokens)  # the prompt was just evaluated
            tok = int(orig_sample(*a, **kw))
            now = time.perf_counter()
            st["n"] += 1
            st["t_first"] = st["t_first"] or now
            st["t_last"] = now
            if _is_eog(llm, tok):
                st["eog"] += 1
            return tok

        llm.sample = sample
        try:
            if self.r.exists(job_cancel_key(job_id)):
                raise JobCancelled
            for text, fr in _generate(llm, job):
                if text:
                    if first_chunk is None:
                        first_chunk = time.time()
                    writer.chunk(text)
                if fr:
                    finish = fr
                if cancel.is_set():
                    raise JobCancelled
            finish = finish or "stop"
        except JobCancelled:
            finish = "cancelled"
        except Exception as exc:  # bad request for this model (context overflow, template...)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            del llm.sample  # back to the class method
        if writer.error and error is None:
            error = writer.error
        n_prompt = int(st["prompt"] or 0)
        n_completion = max(0, int(st["n"]) - int(st["eog"]))
        tps = None
        if st["n"] > 1 and st["t_last"] > st["t_first"]:
            tps = round((st["n"] - 1) / (st["t_last"] - st["t_first"]), 2)
        ttft = round((first_chunk - received) * 1000, 2) if first_chunk is not None else None
        usage = StreamUsage(
            prompt_tokens=n_prompt,
            completion_tokens=n_completion,
            total_tokens=n_prompt + n_completion,
            ttft_ms=ttft,
            tokens_per_s=tps,
        )
        if error is not None:
            writer.fail(error, usage)
            status = "failed"
        else:
            writer.done(finish or "stop", usage)
            status = "cancelled" if finish == "cancelled" else "completed"
        payload = JobFinishedPayload(
            job_id=job_id,
            status=status,  # type: ignore[typeddict-item]
            finish_reason=None if status == "failed" else finish,
            prompt_tokens=n_prompt,
            completion_tokens=n_completion,
            ttft_ms=ttft,
            tokens_per_s=tps,
        )
        if error is not None:
            payload["error"] = error
        return payload


def _is_eog(llm: Any, tok: int) -> bool:
    import llama_cpp

    try:
        return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok))
    except AttributeError:
        return bool(tok == llm.token_eos())


def _sampling_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    max_tokens = int(job.get("max_tokens") or 0)
    kw: dict[str, Any] = {
        "max_tokens": max_tokens if max_tokens > 0 else None,
        "temperature": float(job.get("temperature", 0.8)),
        "top_p": float(job.get("top_p", 0.95)),
        "stop": list(job.get("stop") or []),
        "presence_penalty": float(job.get("presence_penalty", 0.0)),
        "frequency_penalty": float(job.get("frequency_penalty", 0.0)),
        "stream": True,
    }
    if job.get("seed") is not None:
        kw["seed"] = int(job["seed"])
    return kw


def _generate(llm: Any, job: dict[str, Any]) -> Any:
    """Yield (text, finish_reason) per streamed chunk, chat (model's own template) or completion."""
    kw = _sampling_kwargs(job)
    if job.get("kind", "chat") == "chat":
        messages = job.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat job needs a non-empty 'messages' list")
        for chunk in llm.create_chat_completion(messages=messages, **kw):
            choice = chunk["choices"][0]
            yield choice.get("delta", {}).get("content") or "", choice.get("finish_reason")
    else:
        prompt = job.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("completion job needs a 'prompt' string")
        for chunk in llm.create_completion(prompt=prompt, **kw):
            choice = chunk["choices"][0]
            yield choice.get("text") or "", choice.get("finish_reason")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="primary")
    p.add_argument("--plan", required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--msg-fd", type=int, required=True)
    args = p.parse_args(argv)
    watch_parent()
    child = Child(args)
    threading.Thread(target=child.read_stdin, name="stdin", daemon=True).start()
    child.load()
    child.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
