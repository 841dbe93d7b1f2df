"""Supervised ggml-rpc worker: a child process lending this machine's CPU and GPUs to the pool.

ggml-rpc has no authentication (and a CVE history), so the child binds 127.0.0.1 on a port of
its own, and an authenticated tunnel (agent/tunnel.py) listens on the node's private advertise
address in front of it: only the primary of a plan, holding that deployment's key, gets a byte
through. A public advertise address is refused as a "Public IP security violation".
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

from agent.protocol import PublicAddressError, is_private_address
from agent.retry import RetryStopped, backoff_delay, retry_call
from agent.runtime import EventSink, PortInUse, RuntimeErrorReport
from agent.runtime.child import log_tail, readline_timeout, spawn, stop_process
from agent.tunnel import TunnelServer, TunnelTls

log = logging.getLogger("agent.runtime.rpc_worker")

# A worker that ran this long counts as healthy again: the next crash restarts without waiting.
STABLE_AFTER_S = 60.0


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUse (with a clear message) when host:port cannot be bound right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Same option ggml sets, so a port in TIME_WAIT is not mistaken for a busy one.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"RPC port {port} on {host} is already in use by another process; "
                f"stop it or start the agent with --rpc-port",
                data={"host": host, "port": port},
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise PortInUse(
                f"advertise address {host} is not an address of this machine",
                data={"host": host, "port": port},
            ) from None
        raise PortInUse(
            f"cannot bind {host}:{port}: {exc}", data={"host": host, "port": port}
        ) from None
    finally:
        s.close()


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class RpcWorker:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        cache_dir: Path,
        n_threads: int,
        log_path: Path,
        on_event: EventSink,
        ready_timeout: float = 30.0,
        restart: bool = True,
        backoff_cap: float = 30.0,
        tunnel: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self.endpoint = format_endpoint(host, port)
        self.cache_dir = cache_dir
        self.n_threads = n_threads
        self.log_path = log_path
        self.on_event = on_event
        self.ready_timeout = ready_timeout
        self.restart = restart
        self.backoff_cap = backoff_cap
        self.devices: list[dict[str, Any]] = []
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._msg: IO[str] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        # tunnel=False binds ggml-rpc itself to host:port (only bench/rpc_tunnel.py's direct arm).
        self.tunnel: TunnelServer | None = None
        self._use_tunnel = tunnel
        self.probe_key: bytes | None = None  # link probes are refused until allow_probes
        self.listen_port = port

    # --- public -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def status(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "endpoint": self.endpoint,
            "devices": self.devices,
            "restarts": self.restarts,
            "tunnel": self._use_tunnel,
        }

    def authorize(
        self, deployment_id: str, key_hex: str, peer_host: str | None, tls: TunnelTls
    ) -> None:
        """Let that deployment's primary (from peer_host, with the deployment's certificate)
        through the tunnel; ValueError if the key or certificate is bad."""
        if self.tunnel is None:
            raise ValueError("the RPC worker is not running behind its tunnel")
        self.tunnel.authorize(deployment_id, key_hex, peer_host, tls)

    def allow_probes(self, probe_key: bytes) -> None:
        self.probe_key = probe_key
        if self.tunnel is not None:
            self.tunnel.probe_key = probe_key

    def start(self) -> dict[str, Any]:
        """Start and wait until it listens. Reports RPC_WORKER_STARTED or a failure event.

        Raises PublicAddressError or RuntimeErrorReport (PortInUse included) after reporting.
        """
        with self._lock:
            if self.running:
                return self.status()
            self._stopping.clear()
            try:
                self._start_once()
            except PublicAddressError as exc:
                self.on_event(
                    "PUBLIC_IP_VIOLATION", str(exc), {"address": self.host, "role": "rpc_worker"}
                )
                raise
            except RuntimeErrorReport as exc:
                self.on_event(
                    "RPC_WORKER_FAILED", str(exc), {"endpoint": self.endpoint, **exc.data}
                )
                raise
            if self._monitor is None or not self._monitor.is_alive():
                self._monitor = threading.Thread(
                    target=self._supervise, name="rpc-worker", daemon=True
                )
                self._monitor.start()
            return self.status()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            proc = self._proc
            if proc is not None:
                stop_process(proc, timeout)
            if self._msg is not None:
                self._msg.close()
                self._msg = None
            if self.tunnel is not None:
                self.tunnel.stop()
                self.tunnel = None
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout)

    # --- internals ----------------------------------------------------------------------------

    def _start_once(self) -> None:
        if not is_private_address(self.host):
            raise PublicAddressError(self.host)
        if self.tunnel is None:
            check_port_free(self.host, self.port)
        listen_host = "127.0.0.1" if self._use_tunnel else self.host
        self.listen_port = _free_loopback_port() if self._use_tunnel else self.port
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        proc, msg = spawn(
            "agent.runtime.rpc_worker_main",
            [
                "--endpoint",
                format_endpoint(listen_host, self.listen_port),
                "--cache-dir",
                str(self.cache_dir),
                "--threads",
                str(self.n_threads),
            ],
            log_path=self.log_path,
        )
        if self._msg is not None:
            self._msg.close()
        self._proc, self._msg = proc, msg
        # "devices" just before serving, or "failed", or EOF when it died early.
        first = readline_timeout(msg, self.ready_timeout)
        try:
            hello = json.loads(first) if first else {}
        except ValueError:
            hello = {}
        if hello.get("op") != "devices":
            stop_process(proc, 2)
            reason = hello.get("error") or "; ".join(log_tail(self.log_path, 5)) or "no output"
            raise RuntimeErrorReport(
                f"RPC worker on {self.endpoint} failed to start (exit {proc.returncode}): {reason}",
                data={"exit_code": proc.returncode},
            )
        if not wait_listening(listen_host, self.listen_port, self.ready_timeout, proc):
            stop_process(proc, 2)
            tail = "; ".join(log_tail(self.log_path, 5))
            raise RuntimeErrorReport(
                f"RPC worker on {self.endpoint} did not start listening: {tail or 'no output'}",
                data={"exit_code": proc.returncode},
            )
        self.devices = list(hello.get("devices", []))
        if self._use_tunnel:
            if self.tunnel is None:
                self.tunnel = TunnelServer(
                    host=self.host,
                    port=self.port,
                    target_port=self.listen_port,
                    on_refused=lambda msg, data: self.on_event("RPC_TUNNEL_REFUSED", msg, data),
                    probe_key=self.probe_key,
                )
                try:
                    self.tunnel.start()
                except OSError as exc:
                    self.tunnel = None
                    stop_process(proc, 2)
                    raise PortInUse(
                        f"cannot open the RPC tunnel on {self.endpoint}: {exc}"
                    ) from None
            self.tunnel.target_port = self.listen_port  # a restarted worker has a new port
        log.info("RPC worker listening on %s (pid %s)", self.endpoint, proc.pid)
        self.on_event(
            "RPC_WORKER_STARTED",
            f"ggml-rpc worker listening on {self.endpoint}",
            {
                "endpoint": self.endpoint,
                "devices": self.devices,
                "memory_total": sum(int(d.get("memory_total", 0)) for d in self.devices),
                "memory_free": sum(int(d.get("memory_free", 0)) for d in self.devices),
                "pid": proc.pid,
            },
        )

    def _supervise(self) -> None:
        failures = 0  # restarts since the worker last ran STABLE_AFTER_S: the backoff grows with it
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            started = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started > STABLE_AFTER_S:
                failures = 0
            tail = log_tail(self.log_path, 5)
            message = f"RPC worker on {self.endpoint} exited with code {code}"
            log.warning("%s; restarting with backoff", message)
            self.on_event(
                "RPC_WORKER_FAILED",
                message,
                {"endpoint": self.endpoint, "exit_code": code, "log_tail": tail},
            )
            if not self.restart:
                return
            try:
                failures = self._restart(failures)
            except RetryStopped:
                return

    def _restart(self, failures: int) -> int:
        """Wait, start the child again (retrying with backoff); return the failures so far."""
        tries = 0

        def start() -> None:
            nonlocal tries
            tries += 1
            with self._lock:
                if self._stopping.is_set():
                    raise RetryStopped
                self._start_once()
                self.restarts += 1

        def failed(exc: BaseException, _: int, __: float) -> None:
            self.on_event(
                "RPC_WORKER_FAILED", f"restart failed: {exc}", {"endpoint": self.endpoint}
            )

        # The crash itself counts as the first failure, so even the first restart waits.
        if self._stopping.wait(backoff_delay(failures, base=1.0, cap=self.backoff_cap)):
            raise RetryStopped
        retry_call(
            start,
            retry_on=(RuntimeErrorReport, PublicAddressError, OSError),
            base=1.0,
            cap=self.backoff_cap,
            stop=self._stopping,
            on_retry=failed,
            offset=failures + 1,
        )
        return failures + tries
