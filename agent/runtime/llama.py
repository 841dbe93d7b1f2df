"""The real runtime: the ggml-rpc worker (llama-cpp-python's libraries) and llama-server primaries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis

from agent.protocol import LoadPrimaryPayload
from agent.runtime import EventSink, JobFinishedSink, RuntimeErrorReport
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.server import ServerPrimary, find_llama_server


def llama_rpc_support() -> tuple[bool, str]:
    """Whether this llama-cpp-python was built with GGML_RPC=ON (FACTS.md: pip's cache can lie)."""
    try:
        # Optional (the [agent] extra), and importing it loads libllama: only when asked.
        import llama_cpp  # noqa: PLC0415
    except ImportError as exc:
        return False, f"llama-cpp-python is not installed: {exc}"
    except OSError as exc:  # the shared library failed to load
        return False, f"llama-cpp-python's library failed to load: {exc}"
    version = getattr(llama_cpp, "__version__", "?")
    try:
        ok = bool(llama_cpp.llama_supports_rpc())
    except AttributeError:
        ok = False
    if not ok:
        return False, (
            f"llama-cpp-python {version} has no RPC support; reinstall with "
            "CMAKE_ARGS=-DGGML_RPC=ON pip install --no-cache-dir --force-reinstall llama-cpp-python"
        )
    return True, f"llama-cpp-python {version} with RPC support"


class LlamaRuntime:
    name = "llama.cpp"

    def __init__(self, *, load_timeout: float = 600.0, ready_timeout: float = 30.0) -> None:
        self.load_timeout = load_timeout
        self.ready_timeout = ready_timeout

    def check(self) -> tuple[bool, str]:
        ok, detail = llama_rpc_support()
        if not ok:
            return ok, detail
        try:
            server = find_llama_server()
        except RuntimeErrorReport as exc:
            return False, str(exc)
        if not server.is_file():
            return False, f"llama-server not found at {server}"
        return True, f"{detail}; llama-server {server}"

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
