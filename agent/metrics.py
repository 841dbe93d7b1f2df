"""A tiny Prometheus text endpoint (off unless --metrics-port is given). No dependency."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Snapshot = Callable[[], dict[str, Any]]


def render(snapshot: dict[str, Any]) -> str:
    lines = [
        "# HELP racon_agent_state Current agent state (1 for the active state).",
        "# TYPE racon_agent_state gauge",
    ]
    for state in ("UNINITIALIZED", "REGISTERING", "READY", "DEGRADED", "DRAINING", "ERROR"):
        lines.append(f'racon_agent_state{{state="{state}"}} {int(snapshot.get("state") == state)}')
    gauges = {
        "racon_agent_jobs_running": len(snapshot.get("jobs", [])),
        "racon_agent_primaries": len(snapshot.get("primaries", [])),
        "racon_agent_rpc_worker_up": int(bool(snapshot.get("rpc_worker", {}).get("running"))),
        "racon_agent_mem_available_bytes": snapshot.get("mem_available", 0),
        "racon_agent_cpu_percent": snapshot.get("cpu_percent", 0.0),
    }
    counters = {
        "racon_agent_commands_total": snapshot.get("commands_total", 0),
        "racon_agent_jobs_finished_total": snapshot.get("jobs_finished_total", 0),
        "racon_agent_completion_tokens_total": snapshot.get("completion_tokens_total", 0),
    }
    for name, value in gauges.items():
        lines += [f"# TYPE {name} gauge", f"{name} {value}"]
    for name, value in counters.items():
        lines += [f"# TYPE {name} counter", f"{name} {value}"]
    return "\n".join(lines) + "\n"


class MetricsServer:
    def __init__(self, host: str, port: int, snapshot: Snapshot) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(outer.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
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
        self.httpd.shutdown()
        self.httpd.server_close()
