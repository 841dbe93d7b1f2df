"""The agent's Prometheus endpoint (off unless --metrics-port is given), on prometheus_client.

It serves what only the node knows: loaded models, the RPC worker, the last job's speed, memory in
use. The controller's /metrics has the cluster's view. Each server has a registry of its own,
whose one collector reads the agent's snapshot at every scrape. The server binds the private
advertise address only; a port already taken is reported by the caller, and the agent runs on
without it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.state import AgentState

log = logging.getLogger("agent.metrics")

Snapshot = Callable[[], dict[str, Any]]
# The classic text format: what scrapers, and this endpoint before prometheus_client, speak.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATES = tuple(s.value for s in AgentState)


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _gauge(
    name: str,
    doc: str,
    value: Any = None,
    *,
    labels: Sequence[str] = (),
    samples: Iterable[tuple[Sequence[Any], Any]] = (),
) -> GaugeMetricFamily:
    """One gauge: unlabelled with `value`, or labelled with one (label values, value) per sample."""
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    if not labels:
        family.add_metric([], _number(value))
    for values, v in samples:
        family.add_metric([str(x) for x in values], _number(v))
    return family


def process_memory() -> dict[str, int]:
    """Bytes in use: the machine's (total - available) and this agent's process tree (RSS)."""
    out: dict[str, int] = {}
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
    except Exception:  # a scrape must not fail on one figure
        log.debug("memory figures unavailable", exc_info=True)
    return out


def families(snapshot: dict[str, Any], memory: dict[str, int]) -> Iterator[Metric]:
    """The metric families of an Agent snapshot (missing keys are left out or zero)."""
    yield _gauge(
        "racon_agent_info",
        "The agent's version and node (always 1).",
        labels=("version", "node_id", "node_name"),
        samples=[
            (
                (
                    snapshot.get("agent_version", ""),
                    snapshot.get("node_id") or "",
                    snapshot.get("node_name") or "",
                ),
                1,
            )
        ],
    )
    state = snapshot.get("state")
    yield _gauge(
        "racon_agent_state",
        "Current agent state (1 for the active state).",
        labels=("state",),
        samples=[((s,), int(state == s)) for s in STATES],
    )
    yield _gauge(
        "racon_agent_controller_reachable",
        "1 when the last call to the controller succeeded.",
        int(bool(snapshot.get("controller_reachable", True))),
    )

    # Loaded models: one series per loaded primary. The model name comes with models_loaded
    # (deployment → model); with only the deployment ids the model label is left empty.
    loaded: list[dict[str, Any]] = list(snapshot.get("models_loaded") or [])
    if not loaded:
        loaded = [{"deployment_id": d, "model": ""} for d in snapshot.get("primaries", [])]
    yield _gauge(
        "racon_agent_models_loaded", "Models loaded by this node's primaries.", len(loaded)
    )
    yield _gauge(
        "racon_agent_model_loaded",
        "A loaded model (always 1), by deployment.",
        labels=("deployment_id", "model"),
        samples=[
            ((m.get("deployment_id", ""), m.get("model") or m.get("model_name") or ""), 1)
            for m in loaded
        ],
    )
    yield _gauge(
        "racon_agent_models_loading", "Deployments still loading.", len(snapshot.get("loading", []))
    )

    rw = snapshot.get("rpc_worker") or {}
    yield _gauge(
        "racon_agent_rpc_worker_up",
        "1 while the ggml-rpc worker runs.",
        int(bool(rw.get("running"))),
    )
    yield _gauge(
        "racon_agent_jobs_running",
        "Jobs running on this node's primaries.",
        len(snapshot.get("jobs", [])),
    )
    yield _gauge("racon_agent_primaries", "Loaded primaries.", len(snapshot.get("primaries", [])))

    last = snapshot.get("last_job") or {}
    if last.get("tokens_per_s") is not None:
        yield _gauge(
            "racon_agent_last_job_tokens_per_second",
            "Generation speed of the last finished job.",
            last["tokens_per_s"],
        )
    if last.get("ttft_ms") is not None:
        yield _gauge(
            "racon_agent_last_job_ttft_seconds",
            "Time to first token of the last finished job.",
            _number(last["ttft_ms"]) / 1000.0,
        )
    if last.get("completion_tokens") is not None:
        yield _gauge(
            "racon_agent_last_job_completion_tokens",
            "Completion tokens of the last finished job.",
            last["completion_tokens"],
        )

    yield _gauge(
        "racon_agent_mem_available_bytes",
        "Memory available on the machine (last telemetry).",
        snapshot.get("mem_available", 0),
    )
    if "system_used" in memory:
        yield _gauge(
            "racon_agent_memory_used_bytes",
            "Memory in use on the machine (total - available).",
            memory["system_used"],
        )
    if "process_tree_rss" in memory:
        yield _gauge(
            "racon_agent_process_memory_bytes",
            "Resident memory of the agent and its children (primaries, RPC worker).",
            memory["process_tree_rss"],
        )
    yield _gauge(
        "racon_agent_gpu_free_bytes",
        "Free memory per GPU.",
        labels=("gpu",),
        samples=[((i,), v) for i, v in enumerate(snapshot.get("gpu_free") or [])],
    )
    yield _gauge(
        "racon_agent_cpu_percent", "CPU use of the machine.", snapshot.get("cpu_percent", 0.0)
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
        (
            "racon_agent_job_reports_skipped_total",
            "job_reports_skipped_total",
            "Completed jobs whose job_finished report was not sent: the controller had recorded "
            "the end from the stream and released it.",
        ),
    ):
        counter = CounterMetricFamily(name, doc, labels=[])
        counter.add_metric([], _number(snapshot.get(key, 0)))
        yield counter


class SnapshotCollector(Collector):
    """Reads the snapshot (and memory figures) once per scrape."""

    def __init__(self, snapshot: Snapshot, memory: Callable[[], dict[str, int]]) -> None:
        self.snapshot = snapshot
        self.memory = memory

    def collect(self) -> Iterable[Metric]:
        return list(families(self.snapshot(), self.memory()))


def render(snapshot: dict[str, Any], memory: dict[str, int] | None = None) -> str:
    """The Prometheus text exposition of an Agent snapshot."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snapshot, lambda: memory or {}))
    return generate_latest(registry).decode()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the agent log


class MetricsServer:
    """GET /metrics on (host, port). The constructor binds, so a taken port raises OSError at once."""

    def __init__(self, host: str, port: int, snapshot: Snapshot) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(snapshot, process_memory))
        self.httpd = make_server(
            host, port, self._app, server_class=_Server, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.1,), name="metrics", daemon=True
        )

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found\n"]
        try:
            body = generate_latest(self.registry)
        except Exception:  # a broken snapshot must not kill the server thread
            log.exception("metrics scrape failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"metrics scrape failed\n"]
        start_response(
            "200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]
        )
        return [body]

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
