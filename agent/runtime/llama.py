"""The real runtime: the ggml-rpc worker (`ggml-rpc-server`) and llama-server primaries."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import redis

from agent.protocol import LoadPrimaryPayload
from agent.runtime import EventSink, JobFinishedSink, RuntimeErrorReport
from agent.runtime.ggml import GgmlUnavailable
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.rpc_worker_main import find_rpc_server
from agent.runtime.server import ServerPrimary, find_llama_server
from agent.runtime.vllm import VllmPrimary


def llama_rpc_support() -> tuple[bool, str]:
    """Whether this agent's llama.cpp build has llama-server and a ggml-rpc-server that starts.

    The binaries of the backend build are the whole runtime (no llama-cpp-python at run time):
    `ggml-rpc-server --help` loads every library the worker needs, so a missing or foreign
    library (a bundle whose RPATH points elsewhere) fails here, not at the first split."""
    try:
        server = find_llama_server()
        rpc = find_rpc_server()
    except (RuntimeErrorReport, GgmlUnavailable) as exc:
        return False, str(exc)
    if not server.is_file():
        return False, f"llama-server not found at {server}"
    try:
        proc = subprocess.run(
            [str(rpc), "--help"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{rpc} does not run: {exc}"
    if "--port" not in proc.stderr + proc.stdout:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return False, f"{rpc} does not run (exit {proc.returncode}): {tail[0]}"
    return True, f"llama-server and ggml-rpc-server in {rpc.parent}"


class LlamaRuntime:
    name = "llama.cpp"

    def __init__(self, *, load_timeout: float = 600.0, ready_timeout: float = 30.0) -> None:
        self.load_timeout = load_timeout
        self.ready_timeout = ready_timeout

    def check(self) -> tuple[bool, str]:
        return llama_rpc_support()

    def rpc_worker(
        self,
        *,
        host: str,
        port: int,
        cache_dir: Path,
        n_threads: int,
        log_path: Path,
        on_event: EventSink,
    ) -> RpcWorker:
        return RpcWorker(
            host=host,
            port=port,
            cache_dir=cache_dir,
            n_threads=n_threads,
            log_path=log_path,
            on_event=on_event,
            ready_timeout=self.ready_timeout,
        )

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
    ) -> ServerPrimary:
        if plan.get("engine") == "vllm":
            return VllmPrimary(
                node_id=node_id,
                plan=plan,
                model_path=model_path,
                redis_client=redis_client,
                redis_url=redis_url,
                log_path=log_path,
                on_event=on_event,
                on_job_finished=on_job_finished,
                on_exit=on_exit,
                load_timeout=self.load_timeout,
            )
        return ServerPrimary(
            node_id=node_id,
            plan=plan,
            model_path=model_path,
            redis_client=redis_client,
            redis_url=redis_url,
            log_path=log_path,
            on_event=on_event,
            on_job_finished=on_job_finished,
            on_exit=on_exit,
            load_timeout=self.load_timeout,
        )
