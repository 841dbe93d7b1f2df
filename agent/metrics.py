"""The agent's Prometheus endpoint (off unless --metrics-port is given). No dependency but psutil.

It serves what only the node knows: loaded models, the RPC worker, the last job's speed, memory in
use. The controller's /metrics has the cluster's view. The server binds the private advertise
address only; a port already taken is reported by the caller, and the agent runs on without it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("agent.metrics")

Snapshot = Callable[[], dict[str, Any]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATES = ("UNINITIALIZED", "REGISTERING", "READY", "DEGRADED", "DRAINING", "ERROR")


def _escape(value: Any) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: Any) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "NaN"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self, name: str, kind: str, doc: str, samples: Iterable[tuple[dict[str, Any], Any]]
    ) -> None:
        self.lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.lines.append(
                f"{name}{{{lab}}} {_number(value)}" if lab else f"{name} {_number(value)}"
            )


def process_memory() -> dict[str, int]:
    """Bytes in use: the machine's (total - available) and this agent's process tree (RSS)."""
    out: dict[str, int] = {}
    try:
        import psutil
    except ImportError:  # the [agent] extra brings it; without it these series are left out
        return out
    try:
        vm = psutil.virtual_memory()
        out["system_total"] = int(vm.total)
        out["system_used"] = int(vm.total - vm.available)
        me = psutil.Process(os.getpid())
        rss = me.memory_info().rss
        # The primaries (llama.cpp) and the RPC worker are child processes: they hold the weights.
        for child in me.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        out["process_tree_rss"] = int(rss)
    except Exception:  # noqa: BLE001 - a scrape must not fail on one figure
        log.debug("memory figures unavailable", exc_info=True)
    return out


def render(snapshot: dict[str, Any], memory: dict[str, int] | None = None) -> str:
    """The Prometheus text exposition of an Agent.snapshot() (missing keys are left out or zero)."""
    o = _Out()
    o.family(
        "racon_agent_info",
        "gauge",
        "The agent's version and node (always 1).",
        [
            (
                {
                    "version": snapshot.get("agent_version", ""),
                    "node_id": snapshot.get("node_id") or "",
                    "node_name": snapshot.get("node_name") or "",
                },
                1,
            )
        ],
    )
    state = snapshot.get("state")
    o.family(
        "racon_agent_state",
        "gauge",
        "Current agent state (1 for the active state).",
        [({"state": s}, int(state == s)) for s in STATES],
    )
    o.family(
        "racon_agent_controller_reachable",
        "gauge",
        "1 when the last call to the controller succeeded.",
        [({}, int(bool(snapshot.get("controller_reachable", True))))],
    )

    # Loaded models: one series per loaded primary. The model name comes with models_loaded
    # (deployment → model); with only the deployment ids the model label is left empty.
    loaded: list[dict[str, Any]] = list(snapshot.get("models_loaded") or [])
    if not loaded:
        loaded = [{"deployment_id": d, "model": ""} for d in snapshot.get("primaries", [])]
    o.family(
        "racon_agent_models_loaded",
        "gauge",
        "Models loaded by this node's primaries.",
        [({}, len(loaded))],
    )
    o.family(
        "racon_agent_model_loaded",
        "gauge",
        "A loaded model (always 1), by deployment.",
        [
            (
                {
                    "deployment_id": m.get("deployment_id", ""),
                    "model": m.get("model") or m.get("model_name") or "",
                },
                1,
            )
            for m in loaded
        ],
    )
    o.family(
        "racon_agent_models_loading",
        "gauge",
        "Deployments still loading.",
        [({}, len(snapshot.get("loading", [])))],
    )

    rw = snapshot.get("rpc_worker") or {}
    o.family(
        "racon_agent_rpc_worker_up",
        "gauge",
        "1 while the ggml-rpc worker runs.",
        [({}, int(bool(rw.get("running"))))],
    )
    o.family(
        "racon_agent_jobs_running",
        "gauge",
        "Jobs running on this node's primaries.",
        [({}, len(snapshot.get("jobs", [])))],
    )
    o.family(
        "racon_agent_primaries",
        "gauge",
        "Loaded primaries.",
        [({}, len(snapshot.get("primaries", [])))],
    )

    last = snapshot.get("last_job") or {}
    if last.get("tokens_per_s") is not None:
        o.family(
            "racon_agent_last_job_tokens_per_second",
            "gauge",
            "Generation speed of the last finished job.",
            [({}, last["tokens_per_s"])],
        )
    if last.get("ttft_ms") is not None:
        o.family(
            "racon_agent_last_job_ttft_seconds",
            "gauge",
            "Time to first token of the last finished job.",
            [({}, float(last["ttft_ms"]) / 1000.0)],
        )
    if last.get("completion_tokens") is not None:
        o.family(
            "racon_agent_last_job_completion_tokens",
            "gauge",
            "Completion tokens of the last finished job.",
            [({}, last["completion_tokens"])],
        )

    o.family(
        "racon_agent_mem_available_bytes",
        "gauge",
        "Memory available on the machine (last telemetry).",
        [({}, snapshot.get("mem_available", 0))],
    )
    mem = memory if memory is not None else {}
    if "system_used" in mem:
        o.family(
            "racon_agent_memory_used_bytes",
            "gauge",
            "Memory in use on the machine (total - available).",
            [({}, mem["system_used"])],
        )
    if "process_tree_rss" in mem:
        o.family(
            "racon_agent_process_memory_bytes",
            "gauge",
            "Resident memory of the agent and its children (primaries, RPC worker).",
            [({}, mem["process_tree_rss"])],
        )
    o.family(
        "racon_agent_gpu_free_bytes",
        "gauge",
        "Free memory per GPU.",
        [({"gpu": i}, v) for i, v in enumerate(snapshot.get("gpu_free") or [])],
    )
    o.family(
        "racon_agent_cpu_percent",
        "gauge",
        "CPU use of the machine.",
        [({}, snapshot.get("cpu_percent", 0.0))],
    )

    for name, key, doc in (
        ("racon_agent_commands_total", "commands_total", "Commands taken from the node's queue."),
        (
            "racon_agent_jobs_finished_total",
            "jobs_finished_total",
            "Jobs this node finished (any outcome).",
        ),
        (
            "racon_agent_completion_tokens_total",
            "completion_tokens_total",
            "Completion tokens this node generated.",
        ),
    ):
        o.family(name, "counter", doc, [({}, snapshot.get(key, 0))])
    return "\n".join(o.lines) + "\n"


class MetricsServer:
    """GET /metrics on (host, port). The constructor binds, so a taken port raises OSError at once."""

    def __init__(self, host: str, port: int, snapshot: Snapshot) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                try:
                    body = render(outer.snapshot(), process_memory()).encode()
                except Exception:  # a broken snapshot must not kill the server thread
                    log.exception("metrics scrape failed")
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would flood the agent log

        self.snapshot = snapshot
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.1,), name="metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics_server(
    host: str, port: int, snapshot: Snapshot
) -> tuple[MetricsServer | None, str | None]:
    """Start the endpoint, or return (None, why) when the port cannot be bound: the agent runs on."""
    try:
        server = MetricsServer(host, port, snapshot)
    except OSError as exc:
        reason = f"metrics port {host}:{port} unavailable ({exc.strerror or exc}); running without metrics"
        log.warning("%s", reason)
        return None, reason
    server.start()
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server, None
