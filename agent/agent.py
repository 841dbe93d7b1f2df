"""The Agent: one object composing config, identity, client, hardware, queue and runtime.

Threads, and why each exists:
- main: takes commands from the node's Redis queue and dispatches them. Quick commands (run_job,
  cancel_job) run inline so a job reaches its primary with no extra hop; slow ones go to workers.
- control worker (1 thread): rpc_start / rpc_stop / load_primary / unload, serialised so a stop
  and a start, or a load and an unload, can never interleave.
- io worker: probe_links / rescan_models / fetch_model (network and disk bound).
- heartbeat: telemetry on the controller's interval; llama.cpp calls block, so it must not share
  a thread with anything that runs them.
- outbox: sends reports in order, retrying until accepted; only then is a command acknowledged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis

from agent import __version__
from agent.client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailable,
    NodeRevoked,
    Unauthorized,
    backoff_delay,
)
from agent.config import AgentConfig
from agent.hardware import HardwareSource, hardware_source
from agent.identity import (
    Identity,
    ensure_private_dir,
    load_identity,
    machine_id,
    save_identity,
    write_private_file,
)
from agent.links import probe_peer
from agent.models import FetchError, ShaCache, fetch_model, resolve_model, scan_models
from agent.protocol import (
    COMMAND_KINDS,
    SILENT_ON_SUCCESS,
    EnrollRequest,
    Hardware,
    JobFinishedPayload,
    LoadPrimaryPayload,
    PublicAddressError,
    Report,
    is_private_address,
    job_cancel_key,
    new_id,
)
from agent.queue import CommandQueue, QueueItem
from agent.runtime import PrimaryHandle, RpcWorkerHandle, Runtime, RuntimeErrorReport
from agent.runtime.primary import PlanError, check_memory, validate_plan_shape
from agent.runtime.stream import append_done, append_error

log = logging.getLogger("agent")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_REFUSED = 3  # revoked, or the controller refused the enrollment token / credential


class AgentState(StrEnum):
    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    DRAINING = "DRAINING"
    ERROR = "ERROR"


class FatalAgentError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class CommandError(Exception):
    """A command this node refuses; becomes command_result {ok: false, error}."""


@dataclass
class Deployment:
    deployment_id: str
    plan: LoadPrimaryPayload
    state: str = "loading"  # loading → loaded | failed
    primary: PrimaryHandle | None = None
    loading: PrimaryHandle | None = None  # the handle while load() runs, so shutdown can stop it
    pending: list[dict[str, Any]] = field(default_factory=list)  # jobs that arrived while loading
    result: dict[str, Any] = field(default_factory=dict)


# --- the outbox --------------------------------------------------------------------------------


class Outbox:
    """Reports in order, each retried with capped backoff until the controller accepts it."""

    def __init__(self, agent: Agent, client: ControllerClient, backoff_cap: float = 30.0) -> None:
        self.agent = agent
        self.client = client
        self.backoff_cap = backoff_cap
        self._q: list[tuple[Report, Any]] = []
        self._cv = threading.Condition()
        self._busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, report: Report, on_accepted: Any = None) -> None:
        with self._cv:
            self._q.append((report, on_accepted))
            self._cv.notify()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                while not self._q and not self._stop.is_set():
                    self._cv.wait(0.5)
                if self._stop.is_set():
                    return
                report, callback = self._q[0]
                self._busy = True
            accepted = self._send(report)
            with self._cv:
                if self._q and self._q[0][0] is report:
                    self._q.pop(0)
                self._busy = False
                self._cv.notify_all()
            if accepted and callback is not None:
                try:
                    callback()
                except Exception:
                    log.exception("after-report callback failed")

    def _send(self, report: Report) -> bool:
        attempt = 0
        while not self._stop.is_set() and not self.agent.revoked:
            try:
                self.client.report(report, retries=0)
                return True
            except NodeRevoked as exc:
                self.agent._on_revoked(exc)
                return False
            except Unauthorized as exc:
                self.agent._on_credential_refused(exc)
                return False
            except ControllerError as exc:
                # A final 4xx: resending cannot help. Count it as handled so its command is
                # acknowledged rather than retried forever.
                log.error("controller rejected %s report: %s", report["kind"], exc)
                return True
            except ControllerUnavailable:
                delay = backoff_delay(attempt, base=0.5, cap=self.backoff_cap)
                attempt += 1
                if self._stop.wait(delay):
                    return False
        return False


# --- the agent ---------------------------------------------------------------------------------


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        runtime: Runtime | None = None,
        hardware: HardwareSource | None = None,
        client: ControllerClient | None = None,
        install_signals: bool = True,
    ) -> None:
        self.config = config
        if runtime is None:
            from agent.runtime.llama import LlamaRuntime

            runtime = LlamaRuntime()
        self.runtime: Runtime = runtime
        self.hw: HardwareSource = hardware or hardware_source(
            config.models_dir, config.state_dir, config.hardware_profile
        )
        self.client = client or ControllerClient(config.controller_url)
        self.install_signals = install_signals
        self.identity: Identity | None = None
        self.redis: redis.Redis | None = None
        self.redis_url = ""
        self.queue: CommandQueue | None = None
        self.outbox = Outbox(self, self.client)
        self.sha_cache = ShaCache(config.state_dir)
        self.rpc_worker: RpcWorkerHandle | None = None
        self.deployments: dict[str, Deployment] = {}
        self.jobs: dict[str, str] = {}  # job_id → deployment_id, until job_finished
        self.hardware: Hardware | None = None
        self.exit_code = EXIT_OK
        self.revoked = False  # revoked or credential refused: nothing more can be reported
        self.controller_state: str | None = None
        self.heartbeat_interval = 5.0
        self.counters = {
            "commands_total": 0,
            "jobs_finished_total": 0,
            "completion_tokens_total": 0,
        }
        self.last_job: dict[str, Any] = {}
        self._state = AgentState.UNINITIALIZED
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._hb_wake = threading.Event()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._inflight: set[str] = set()
        self._control = ThreadPoolExecutor(1, thread_name_prefix="control")
        self._io = ThreadPoolExecutor(2, thread_name_prefix="io")
        self._metrics: Any = None
        self._redis_ok: bool | None = None
        self._log_dir = config.state_dir / "logs"

    # --- state --------------------------------------------------------------------------------

    @property
    def state(self) -> AgentState:
        return self._state

    @property
    def node_id(self) -> str | None:
        return self.identity.node_id if self.identity else None

    def _set_state(self, state: AgentState, why: str = "") -> None:
        with self._lock:
            if self._state == state:
                return
            old, self._state = self._state, state
        log.info("state %s → %s%s", old.value, state.value, f" ({why})" if why else "")
        if state == AgentState.READY:
            self._ready.set()
        else:
            self._ready.clear()
        self._hb_wake.set()  # the controller should learn about it now, not in one interval

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def request_stop(self, reason: str = "stop requested", exit_code: int | None = None) -> None:
        if exit_code is not None and self.exit_code == EXIT_OK:
            self.exit_code = exit_code
        if not self._stop.is_set():
            log.info("stopping: %s", reason)
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # --- run ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped (SIGTERM/SIGINT, revocation, or request_stop). Returns an exit code."""
        if self.install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.request_stop("SIGTERM: draining"))
            signal.signal(signal.SIGINT, lambda *_: self.request_stop("SIGINT: draining"))
        try:
            ensure_private_dir(self.config.state_dir)
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self._startup()
            if not self._stop.is_set():
                self._main_loop()
        except FatalAgentError as exc:
            log.error("%s", exc)
            self.exit_code = exc.exit_code
            self._set_state(AgentState.ERROR, str(exc))
        except Exception:
            log.exception("agent failed unexpectedly")
            self.exit_code = EXIT_ERROR
        finally:
            self._shutdown()
        return self.exit_code

    def _startup(self) -> None:
        self._set_state(AgentState.UNINITIALIZED, "discovering hardware")
        stored = load_identity(self.config.state_dir)
        resumable = stored is not None and stored.controller_url == self.config.controller_url
        if resumable:
            assert stored is not None
            self._adopt(stored)
            resumable = self._credential_still_valid()
        if resumable:
            self._start_heartbeat()  # the controller sees UNINITIALIZED → REGISTERING → READY
        self.hardware = self.hw.inventory(benchmark=self.config.run_benchmarks)
        models = scan_models(self.config.models_dir, self.sha_cache)
        self._set_state(AgentState.REGISTERING, "handshake with the controller")
        if resumable:
            log.info("resuming as node %s (stored credential)", self.node_id)
            # Hardware may have changed since enrollment (RAM added, GPU swapped).
            self._event(
                "HARDWARE_UPDATED",
                "hardware inventory at agent start",
                {"hardware": self.hardware, "models": models, "agent_version": __version__},
            )
        else:
            if stored is not None:
                log.info(
                    "stored credential is for %s; enrolling with %s",
                    stored.controller_url,
                    self.config.controller_url,
                )
            self._enroll(self.hardware, models, stored=stored)
            if self._stop.is_set():
                return
            self._start_heartbeat()
        self._connect_redis()
        self.outbox.start()
        self._start_metrics()
        self._runtime_checks()

    def _credential_still_valid(self) -> bool:
        """One synchronous beat before trusting a stored credential.

        A controller whose database was reset no longer knows us: with a token at hand we enroll
        again instead of stopping. Revocation is final either way. An unreachable controller
        proves nothing, so we keep the credential and let the heartbeat thread retry.
        """
        hb = {"state": AgentState.UNINITIALIZED.value, "sent_at": time.time(), "telemetry": {}}
        try:
            self.client.heartbeat(hb)  # type: ignore[arg-type]
        except NodeRevoked as exc:
            self.revoked = True  # nothing more can be reported
            raise FatalAgentError(f"{exc} — this node can no longer serve", EXIT_REFUSED) from None
        except Unauthorized as exc:
            if not self.config.enrollment_token:
                self.revoked = True
                raise FatalAgentError(
                    f"the controller no longer accepts the stored credential ({exc}); restart "
                    "with --enrollment-token to enroll again",
                    EXIT_REFUSED,
                ) from None
            log.warning("stored credential refused (%s); enrolling again with the token", exc)
            self.identity = None
            return False
        except (ControllerUnavailable, ControllerError):
            pass
        return True

    def _adopt(self, identity: Identity) -> None:
        self.identity = identity
        self.client.set_credentials(identity.node_id, identity.credential)
        self.redis_url = self.config.redis_url or identity.redis_url

    def _enroll(self, hardware: Hardware, models: list[Any], *, stored: Identity | None = None) -> None:
        """Enroll with the token; a stored credential is presented too, since the controller lets
        an enrolled machine re-enroll only with its node's current credential."""
        token = self.config.enrollment_token
        if not token:
            raise FatalAgentError(
                f"no stored credential in {self.config.state_dir} and no --enrollment-token "
                "(or RACON_ENROLLMENT_TOKEN): ask an administrator for a token",
                EXIT_CONFIG,
            )
        req = EnrollRequest(
            token=token,
            node_name=self.config.node_name,
            machine_id=machine_id(self.config.state_dir),
            agent_version=__version__,
            advertise_address=self.config.advertise_address,
            rpc_port=self.config.rpc_port,
            hardware=hardware,
            models=models,
        )
        attempt = 0
        while not self._stop.is_set():
            try:
                resp = self.client.enroll(
                    req, retries=0, presented=(stored.node_id, stored.credential) if stored else None
                )
                break
            except (NodeRevoked, Unauthorized) as exc:
                raise FatalAgentError(
                    f"enrollment refused by the controller: {exc}", EXIT_REFUSED
                ) from None
            except ControllerError as exc:
                raise FatalAgentError(f"enrollment failed: {exc}", EXIT_REFUSED) from None
            except ControllerUnavailable:
                # The client logged the outage once; keep trying with capped backoff.
                if self._stop.wait(backoff_delay(attempt, base=1.0, cap=30.0)):
                    return
                attempt += 1
        else:
            return
        identity = Identity(
            node_id=str(resp["node_id"]),
            credential=str(resp["credential"]),
            controller_url=self.config.controller_url,
            redis_url=str(resp["redis_url"]),
            node_name=self.config.node_name,
        )
        save_identity(self.config.state_dir, identity)
        self._adopt(identity)
        self.heartbeat_interval = float(resp.get("heartbeat_interval") or self.heartbeat_interval)
        log.info("enrolled as node %s (%s)", identity.node_id, self.config.node_name)

    def _connect_redis(self) -> None:
        assert self.identity is not None
        if not self.redis_url:
            raise FatalAgentError("the controller gave no Redis URL and --redis-url is not set")
        self.redis = redis.Redis.from_url(
            self.redis_url,
            decode_responses=True,
            socket_timeout=15,
            socket_connect_timeout=5,
            health_check_interval=30,
        )
        self.queue = CommandQueue(self.redis, self.identity.node_id)
        attempt = 0
        while not self._stop.is_set():
            try:
                self.queue.recover()
                self._mark_redis(True)
                return
            except redis.RedisError as exc:
                self._mark_redis(False, exc)
                if self._stop.wait(backoff_delay(attempt, base=1.0, cap=30.0)):
                    return
                attempt += 1

    def _mark_redis(self, ok: bool, exc: Exception | None = None) -> None:
        if self._redis_ok is ok:
            return
        before, self._redis_ok = self._redis_ok, ok
        if ok and before is False:
            log.info("Redis %s is reachable again", _redact(self.redis_url))
        elif not ok:
            log.warning(
                "Redis %s unreachable (%s); retrying with backoff", _redact(self.redis_url), exc
            )

    def _runtime_checks(self) -> None:
        ok, detail = self.runtime.check()
        if not ok:
            self._fault(f"runtime check failed: {detail}", fatal=True)
            self._set_state(AgentState.ERROR, detail)
            return
        log.info("runtime: %s", detail)
        if not self.config.rpc_worker:
            self._set_state(AgentState.READY, "runtime checks passed (no RPC worker)")
            return
        try:
            self._start_rpc_worker()
        except PublicAddressError as exc:
            self._set_state(AgentState.ERROR, str(exc))
            return
        except RuntimeErrorReport as exc:
            self._fault(str(exc), fatal=False)
            self._set_state(AgentState.DEGRADED, str(exc))
            return
        self._set_state(AgentState.READY, "runtime checks passed")

    def _start_rpc_worker(self) -> dict[str, Any]:
        if self.rpc_worker is None:
            self.rpc_worker = self.runtime.rpc_worker(
                host=self.config.advertise_address,
                port=self.config.rpc_port,
                cache_dir=self.config.state_dir / "rpc-cache",
                n_threads=self.config.rpc_threads or _cpu_threads(),
                log_path=self._log_dir / "rpc-worker.log",
                on_event=self._event,
            )
        return self.rpc_worker.start()

    # --- main loop ----------------------------------------------------------------------------

    def _main_loop(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            assert self.queue is not None
            try:
                item = self.queue.take(timeout=0.5)  # also bounds how long a stop waits
                self._mark_redis(True)
                attempt = 0
            except redis.RedisError as exc:
                self._mark_redis(False, exc)
                self._stop.wait(backoff_delay(attempt, base=0.5, cap=10.0))
                attempt += 1
                continue
            if item is None:
                continue
            self.counters["commands_total"] += 1
            try:
                self._dispatch(item)
            except Exception as exc:  # never let one command take the agent down
                log.exception("command %s failed", item.id)
                self._finish(item, ok=False, error=f"internal error: {type(exc).__name__}: {exc}")

    def _dispatch(self, item: QueueItem) -> None:
        if item.command is None:
            log.warning("%s", item.error)
            self._finish(item, ok=False, error=item.error or "malformed command")
            return
        cid = str(item.command["id"])
        assert self.queue is not None
        if cid in self._inflight or self.queue.is_duplicate(cid):
            log.info("duplicate command %s (%s) ignored", cid, item.kind)
            self._ack(item)
            return
        kind = item.kind
        if kind not in COMMAND_KINDS:
            self._finish(item, ok=False, error=f"unknown command kind {kind!r}")
            return
        self._inflight.add(cid)
        payload = item.command["payload"]
        handler = getattr(self, f"_cmd_{kind}")
        if kind in ("run_job", "cancel_job"):
            self._run_command(handler, item, payload)
        elif kind == "load_primary":
            # Registered now, so a run_job right behind it waits for the load instead of failing.
            try:
                plan = validate_plan_shape(payload)
            except PublicAddressError as exc:
                self._public_violation(exc, "load_primary")
                self._finish(item, ok=False, error=str(exc))
                return
            except PlanError as exc:
                self._finish(item, ok=False, error=str(exc))
                return
            with self._lock:
                existing = self.deployments.get(plan["deployment_id"])
                if existing is None:
                    self.deployments[plan["deployment_id"]] = Deployment(
                        plan["deployment_id"], plan
                    )
            if existing is not None:
                if existing.plan == plan and existing.state != "failed":
                    self._finish(item, ok=True, already_loaded=True, **existing.result)
                else:
                    self._finish(
                        item,
                        ok=False,
                        error=(
                            f"deployment {plan['deployment_id']} is already loaded with another plan; "
                            "unload it first"
                        ),
                    )
                return
            self._control.submit(self._run_command, handler, item, dict(plan))
        elif kind in ("rpc_start", "rpc_stop", "unload"):
            self._control.submit(self._run_command, handler, item, payload)
        else:
            self._io.submit(self._run_command, handler, item, payload)

    def _run_command(self, handler: Any, item: QueueItem, payload: dict[str, Any]) -> None:
        try:
            result = handler(payload)
        except CommandError as exc:
            self._finish(item, ok=False, error=str(exc))
        except PublicAddressError as exc:
            self._public_violation(exc, item.kind)
            self._finish(item, ok=False, error=str(exc))
        except (RuntimeErrorReport, PlanError, FetchError) as exc:
            self._finish(item, ok=False, error=str(exc))
        except Exception as exc:
            log.exception("command %s (%s) failed", item.id, item.kind)
            self._finish(item, ok=False, error=f"internal error: {type(exc).__name__}: {exc}")
        else:
            self._finish(item, ok=True, **(result or {}))

    def _finish(
        self, item: QueueItem, *, ok: bool, error: str | None = None, **result: Any
    ) -> None:
        """Report the command's result; acknowledge it once the controller accepted the report."""
        if ok and item.kind in SILENT_ON_SUCCESS:
            # Skipping the report keeps an HTTP round trip (and a controller write) off the cores
            # while the prompt is evaluated; a crash from here on loses the runtime as well.
            self._ack(item)
            return
        payload: dict[str, Any] = {"ok": ok, "command": item.kind or None, **result}
        if error is not None:
            payload["error"] = error
            log.warning("command %s (%s) failed: %s", item.id, item.kind or "?", error)
        report = Report(id=new_id(), kind="command_result", command_id=item.id, payload=payload)
        self.outbox.submit(report, on_accepted=lambda: self._ack(item))

    def _ack(self, item: QueueItem) -> None:
        if item.id:
            self._inflight.discard(item.id)
        if self.queue is None:
            return
        try:
            self.queue.ack(item)
        except redis.RedisError as exc:
            # Left in processing: recovered and re-run after a restart (at-least-once).
            log.warning("could not acknowledge command %s: %s", item.id, exc)

    # --- reports ------------------------------------------------------------------------------

    def _event(self, event: str, message: str, data: dict[str, Any] | None = None) -> None:
        level = (
            logging.INFO
            if event.endswith(("STARTED", "LOADED", "UPDATED", "DRAINED"))
            else logging.WARNING
        )
        log.log(level, "%s: %s", event, message)
        self.outbox.submit(
            Report(
                id=new_id(),
                kind="event",
                command_id=None,
                payload={"event": event, "message": message, "data": data or {}},
            )
        )

    def _fault(self, message: str, *, fatal: bool) -> None:
        self.outbox.submit(
            Report(
                id=new_id(),
                kind="fault",
                command_id=None,
                payload={"fatal": fatal, "message": message},
            )
        )

    def _public_violation(self, exc: PublicAddressError, role: str) -> None:
        self._event("PUBLIC_IP_VIOLATION", str(exc), {"address": exc.address, "role": role})

    def _on_revoked(self, exc: Exception) -> None:
        if self.revoked:
            return
        self.revoked = True
        log.error("%s — this node can no longer serve; stopping", exc)
        self._set_state(AgentState.ERROR, "revoked")
        self.request_stop("node revoked", EXIT_REFUSED)

    def _on_credential_refused(self, exc: Exception) -> None:
        if self.revoked:
            return
        self.revoked = True
        log.error(
            "the controller no longer accepts this node's credential (%s); delete %s and restart "
            "with --enrollment-token to enroll again",
            exc,
            self.config.identity_path,
        )
        self._set_state(AgentState.ERROR, "credential refused")
        self.request_stop("credential refused", EXIT_REFUSED)

    def _job_finished(self, payload: JobFinishedPayload) -> None:
        with self._lock:
            self.jobs.pop(payload["job_id"], None)
            self.last_job = {
                k: payload.get(k) for k in ("job_id", "status", "tokens_per_s", "ttft_ms", "completion_tokens")
            }
        self.counters["jobs_finished_total"] += 1
        self.counters["completion_tokens_total"] += int(payload.get("completion_tokens") or 0)
        log.info(
            "job %s %s (%s tokens%s)",
            payload["job_id"],
            payload["status"],
            payload.get("completion_tokens"),
            f", {payload['error']}" if payload.get("error") else "",
        )
        self.outbox.submit(
            Report(id=new_id(), kind="job_finished", command_id=None, payload=dict(payload))
        )

    def _primary_exited(self, deployment_id: str) -> None:
        with self._lock:
            dep = self.deployments.pop(deployment_id, None)
        if dep is not None:
            log.warning("deployment %s is gone; the agent stays up", deployment_id)
        self._hb_wake.set()

    # --- commands -----------------------------------------------------------------------------

    def _cmd_rpc_start(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Start (or confirm) the worker and let the plan's primary through its tunnel."""
        dep_id, key, primary = (payload.get(k) for k in ("deployment_id", "tunnel_key", "primary_address"))
        if key is not None and not (isinstance(dep_id, str) and dep_id and isinstance(key, str)):
            raise CommandError("malformed rpc_start: 'tunnel_key' needs 'deployment_id'")
        if primary is not None and not (isinstance(primary, str) and is_private_address(primary)):
            raise CommandError(f"malformed rpc_start: 'primary_address' {primary!r} is not a private address")
        status = self._start_rpc_worker()
        if key is not None and self.rpc_worker is not None:
            try:
                self.rpc_worker.authorize(dep_id, key, primary)
            except ValueError as exc:
                raise CommandError(f"malformed rpc_start: {exc}") from None
        if self._state in (AgentState.DEGRADED,):
            self._set_state(AgentState.READY, "RPC worker started")
        return {"rpc_worker": status}

    def _cmd_rpc_stop(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.rpc_worker is not None:
            self.rpc_worker.stop()
        return {"rpc_worker": {"running": False, "endpoint": self.config.rpc_endpoint}}

    def _cmd_load_primary(self, plan: LoadPrimaryPayload) -> dict[str, Any]:
        dep_id = plan["deployment_id"]
        try:
            model = resolve_model(
                self.config.models_dir,
                self.sha_cache,
                sha256=plan["sha256"].lower(),
                model_path=plan.get("model_path"),
            )
            if model is None:
                where = (
                    plan.get("model_path") or f"sha256 {plan['sha256']} in {self.config.models_dir}"
                )
                raise PlanError(f"model file not found: {where}")
            check_memory(plan, self.hw.memory_total())
            digest = self.sha_cache.sha256(model)
            if digest != plan["sha256"].lower():
                raise PlanError(
                    f"sha256 mismatch for {model}: the plan expects {plan['sha256'].lower()}, "
                    f"the file has {digest}; refusing to load"
                )
            if self.redis is None:
                raise CommandError("Redis is not connected")
            primary = self.runtime.primary(
                plan=plan,
                node_id=str(self.node_id),
                model_path=model,
                redis_client=self.redis,
                redis_url=self.redis_url,
                log_path=self._log_dir / f"primary-{dep_id}.log",
                on_event=self._event,
                on_job_finished=self._job_finished,
                on_exit=self._primary_exited,
            )
            with self._lock:
                dep = self.deployments.get(dep_id)
                if dep is not None:
                    dep.loading = primary
            loaded = primary.load()
        except Exception as exc:
            self._fail_deployment(dep_id, str(exc))
            raise
        result = {
            "deployment_id": dep_id,
            "model_path": str(model),
            "n_layer": loaded.get("n_layer"),
            "n_ctx": loaded.get("n_ctx"),
            "load_ms": loaded.get("load_ms"),
            "warmup_ms": loaded.get("warmup_ms"),
            "assignment": loaded.get("assignment", []),
            "layer_devices": loaded.get("layer_devices", {}),
            "devices": loaded.get("devices", []),
            "load_log": loaded.get("load_log", []),
            "pid": loaded.get("pid"),
        }
        with self._lock:
            dep = self.deployments.get(dep_id)
            if dep is None:  # unloaded while loading (only via drain): do not leak the process
                primary.stop()
                raise CommandError(f"deployment {dep_id} was unloaded while loading")
            dep.primary, dep.state, dep.result = primary, "loaded", result
            pending, dep.pending = dep.pending, []
        summary = ", ".join(
            f"{a['device']}: {a.get('n_layers', 0)} layers" for a in result["assignment"]
        )
        self._event(
            "PRIMARY_LOADED",
            f"deployment {dep_id} loaded ({summary})",
            {"deployment_id": dep_id, "assignment": result["assignment"]},
        )
        for job in pending:
            self._submit_job(dep_id, primary, job)
        self._hb_wake.set()
        return result

    def _fail_deployment(self, dep_id: str, reason: str) -> None:
        with self._lock:
            dep = self.deployments.pop(dep_id, None)
        for job in dep.pending if dep else []:
            self._fail_job(job["job_id"], f"deployment {dep_id} failed to load: {reason}")

    def _cmd_unload(self, payload: dict[str, Any]) -> dict[str, Any]:
        dep_id = payload.get("deployment_id")
        if not isinstance(dep_id, str) or not dep_id:
            raise CommandError("malformed unload: missing 'deployment_id'")
        with self._lock:
            dep = self.deployments.pop(dep_id, None)
        if dep is None:
            return {"deployment_id": dep_id, "unloaded": False, "reason": "not loaded"}
        for job in dep.pending:
            self._fail_job(job["job_id"], f"deployment {dep_id} was unloaded", cancelled=True)
        if dep.primary is not None:
            dep.primary.stop()
        self._hb_wake.set()
        return {"deployment_id": dep_id, "unloaded": True}

    def _cmd_run_job(self, payload: dict[str, Any]) -> dict[str, Any]:
        job_id = payload.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise CommandError("malformed run_job: missing 'job_id'")
        try:
            job = _validate_job(payload)
        except CommandError as exc:
            self._fail_job(job_id, str(exc))
            raise
        job["_received_at"] = time.time()
        dep_id = job["deployment_id"]
        with self._lock:
            dep = self.deployments.get(dep_id)
            if dep is not None:
                self.jobs[job_id] = dep_id
                if dep.state == "loading":
                    dep.pending.append(job)
                    return {"job_id": job_id, "accepted": True, "queued_behind_load": True}
        if dep is None or dep.primary is None:
            msg = f"deployment {dep_id} is not loaded on this node"
            self._fail_job(job_id, msg)
            raise CommandError(msg)
        error = self._submit_job(dep_id, dep.primary, job)
        if error is not None:
            raise CommandError(error)
        return {"job_id": job_id, "accepted": True}

    def _submit_job(self, dep_id: str, primary: PrimaryHandle, job: dict[str, Any]) -> str | None:
        """Hand a job to its primary; on failure end the job and return why."""
        try:
            primary.submit(job)
        except RuntimeErrorReport as exc:
            self._fail_job(job["job_id"], str(exc))
            return str(exc)
        return None

    def _fail_job(self, job_id: str, reason: str, *, cancelled: bool = False) -> None:
        """End a job that never reached a runtime: error in its stream, job_finished report."""
        if self.redis is not None:
            try:
                if cancelled:
                    append_done(
                        self.redis,
                        job_id,
                        "cancelled",
                        {
                            "prompt_tokens": 0,
                            "completion_tokens": 0,
                            "total_tokens": 0,
                            "ttft_ms": None,
                            "tokens_per_s": None,
                        },
                        node_id=str(self.node_id),
                    )
                else:
                    append_error(self.redis, job_id, reason, node_id=str(self.node_id))
            except redis.RedisError as exc:
                log.error("job %s: cannot write to its stream: %s", job_id, exc)
        self._job_finished(
            JobFinishedPayload(
                job_id=job_id,
                status="cancelled" if cancelled else "failed",
                finish_reason="cancelled" if cancelled else None,
                prompt_tokens=0,
                completion_tokens=0,
                error=reason,
            )
        )

    def _cmd_cancel_job(self, payload: dict[str, Any]) -> dict[str, Any]:
        job_id = payload.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise CommandError("malformed cancel_job: missing 'job_id'")
        if self.redis is not None:
            try:  # the primary also polls this key, which covers a job queued inside the child
                self.redis.set(job_cancel_key(job_id, str(self.node_id)), "1", ex=3600)
            except redis.RedisError:
                pass
        with self._lock:
            dep_id = self.jobs.get(job_id)
            dep = self.deployments.get(dep_id) if dep_id else None
            if dep is not None and dep.state == "loading":
                before = len(dep.pending)
                dep.pending = [j for j in dep.pending if j["job_id"] != job_id]
                waiting = len(dep.pending) != before
            else:
                waiting = False
        if waiting:
            self._fail_job(job_id, "cancelled before its deployment loaded", cancelled=True)
            return {"job_id": job_id, "cancelled": True}
        if dep is not None and dep.primary is not None and dep.primary.cancel(job_id):
            return {"job_id": job_id, "cancelled": True}
        return {"job_id": job_id, "cancelled": False, "reason": "job is not running on this node"}

    def _cmd_probe_links(self, payload: dict[str, Any]) -> dict[str, Any]:
        peers = payload.get("peers")
        if not isinstance(peers, list):
            raise CommandError("malformed probe_links: 'peers' must be a list")
        links = []
        for peer in peers:
            if not isinstance(peer, dict):
                links.append({"node_id": "", "error": "malformed peer entry"})
                continue
            probe = probe_peer(peer)
            if probe.get("public"):
                self._event(
                    "PUBLIC_IP_VIOLATION",
                    probe["error"],
                    {"address": probe["address"], "role": "probe_links"},
                )
            links.append(probe)
        self.outbox.submit(
            Report(id=new_id(), kind="links", command_id=None, payload={"links": links})
        )
        return {"links": len(links), "failed": sum(1 for p in links if "error" in p)}

    def _cmd_rescan_models(self, payload: dict[str, Any]) -> dict[str, Any]:
        models = scan_models(self.config.models_dir, self.sha_cache)
        self.outbox.submit(
            Report(id=new_id(), kind="models", command_id=None, payload={"models": models})
        )
        return {"models": len(models)}

    def _cmd_hash_challenge(self, payload: dict[str, Any]) -> dict[str, Any]:
        """sha256(nonce | bytes[offset:offset+length]) of this node's copy of a model file: the
        controller compares it with its own copy before it trusts the claim "I hold this file"."""
        try:
            sha, nonce = str(payload["sha256"]).lower(), bytes.fromhex(str(payload["nonce"]))
            offset, length = int(payload["offset"]), int(payload["length"])
        except (KeyError, TypeError, ValueError):
            raise CommandError("malformed hash_challenge: needs sha256, nonce (hex), offset and length") from None
        if offset < 0 or not 0 < length <= 16 * 2**20:
            raise CommandError("malformed hash_challenge: offset >= 0 and 0 < length <= 16 MiB")
        path = resolve_model(self.config.models_dir, self.sha_cache, sha256=sha, model_path=payload.get("path"))
        if path is None:
            raise CommandError(f"hash_challenge: no file with sha256 {sha} on this node")
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        return {"digest": hashlib.sha256(nonce + data).hexdigest(), "path": str(path)}

    def _cmd_fetch_model(self, payload: dict[str, Any]) -> dict[str, Any]:
        for key, typ in (("sha256", str), ("file_name", str), ("url", str)):
            if not isinstance(payload.get(key), typ):
                raise CommandError(f"malformed fetch_model: missing {key!r}")
        size = payload.get("size")
        url = payload["url"]
        if url.startswith("/"):
            url = self.config.controller_url + url
        headers = self.client.auth_headers() if url.startswith(self.config.controller_url) else {}
        path = fetch_model(
            url=url,
            dest_dir=self.config.models_dir,
            file_name=payload["file_name"],
            sha256=payload["sha256"],
            size=size if isinstance(size, int) else None,
            headers=headers,
            stop=self._stop,
        )
        self._cmd_rescan_models({})
        return {"path": str(path), "sha256": payload["sha256"].lower(), "size": path.stat().st_size}

    # --- heartbeat ----------------------------------------------------------------------------

    def telemetry(self) -> dict[str, Any]:
        t = dict(self.hw.telemetry())
        with self._lock:
            t["primaries"] = [d for d, dep in self.deployments.items() if dep.state == "loaded"]
            t["loading"] = [d for d, dep in self.deployments.items() if dep.state == "loading"]
            t["jobs"] = list(self.jobs)
        rw = self.rpc_worker
        t["rpc_worker"] = {
            "running": bool(rw and rw.running),
            "endpoint": self.config.rpc_endpoint if self.config.rpc_worker else None,
        }
        t["agent_version"] = __version__
        return t

    def _start_heartbeat(self) -> None:
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name="heartbeat", daemon=True
            )
            self._hb_thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.is_set():
            self._hb_wake.clear()
            self.beat()
            self._write_status()
            deadline = time.monotonic() + self.heartbeat_interval
            while not self._hb_stop.is_set() and not self._hb_wake.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._hb_wake.wait(min(left, 1.0))

    def beat(self) -> None:
        hb = {"state": self._state.value, "sent_at": time.time(), "telemetry": self.telemetry()}
        try:
            resp = self.client.heartbeat(hb)  # type: ignore[arg-type]
        except NodeRevoked as exc:
            self._on_revoked(exc)
            return
        except Unauthorized as exc:
            self._on_credential_refused(exc)
            return
        except ControllerUnavailable:
            return  # logged once per outage by the client
        except ControllerError as exc:
            log.warning("heartbeat rejected: %s", exc)
            return
        interval = resp.get("heartbeat_interval")
        if isinstance(interval, int | float) and 0.2 <= interval <= 3600:
            self.heartbeat_interval = float(interval)
        state = resp.get("state")
        if state and state != self.controller_state:
            log.info("controller lists this node as %s", state)
            self.controller_state = str(state)

    def snapshot(self) -> dict[str, Any]:
        t = self.telemetry()
        with self._lock:
            models_loaded = [
                {"deployment_id": d, "model": dep.plan.get("model_name", "")}
                for d, dep in self.deployments.items()
                if dep.state == "loaded"
            ]
            last_job = dict(self.last_job)
        return {
            "models_loaded": models_loaded,
            "last_job": last_job,
            "state": self._state.value,
            "controller_state": self.controller_state,
            "node_id": self.node_id,
            "node_name": self.config.node_name,
            "controller_url": self.config.controller_url,
            "controller_reachable": self.client.reachable,
            "updated_at": time.time(),
            **t,
            **self.counters,
        }

    def _write_status(self) -> None:
        try:
            write_private_file(
                self.config.status_path, json.dumps(self.snapshot(), indent=2) + "\n"
            )
        except OSError:
            pass

    def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        from agent.metrics import start_metrics_server

        # Same rule as ggml-rpc: never listen on a public address.
        host = self.config.advertise_address
        host = host if is_private_address(host) else "127.0.0.1"
        # A taken port is reported and the agent runs on without metrics (not a node fault).
        self._metrics, problem = start_metrics_server(host, self.config.metrics_port, self.snapshot)
        if problem:
            self._event(
                "METRICS_UNAVAILABLE",
                f"metrics port {self.config.metrics_port} not served: {problem}",
                {"port": self.config.metrics_port},
            )

    # --- drain and shutdown -------------------------------------------------------------------

    def _shutdown(self) -> None:
        revoked = self.revoked
        if self._state not in (AgentState.ERROR,):
            self._set_state(AgentState.DRAINING, "shutting down")
        completed_before = self.counters["jobs_finished_total"]
        cancelled: list[str] = []
        if not revoked:
            deadline = time.monotonic() + self.config.drain_seconds
            while self.jobs and time.monotonic() < deadline:
                time.sleep(0.05)
        with self._lock:
            remaining = list(self.jobs.items())
            deployments = list(self.deployments.values())
        for job_id, dep_id in remaining:
            cancelled.append(job_id)
            dep = self.deployments.get(dep_id)
            if dep is not None and dep.primary is not None:
                dep.primary.cancel(job_id)
        if remaining:
            log.info("drain bound reached: cancelling %d job(s)", len(remaining))
            end = time.monotonic() + 3.0
            while self.jobs and time.monotonic() < end:
                time.sleep(0.05)
        for dep in deployments:
            if dep.primary is None and dep.loading is not None:
                dep.loading.stop(timeout=3.0)  # makes the blocked load() return
            if dep.primary is not None:
                try:
                    dep.primary.stop(timeout=3.0)
                except Exception:
                    log.exception("stopping deployment %s", dep.deployment_id)
            for job in dep.pending:
                self._fail_job(
                    job["job_id"], "agent shut down before the deployment loaded", cancelled=True
                )
        self._control.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self.rpc_worker is not None:
            try:
                self.rpc_worker.stop(timeout=3.0)
            except Exception:
                log.exception("stopping the RPC worker")
        if self.identity is not None and not revoked:
            finished = self.counters["jobs_finished_total"] - completed_before
            self._event(
                "NODE_DRAINED",
                "agent drained and stopping",
                {"jobs_finished_during_drain": finished, "jobs_cancelled": cancelled},
            )
            if self.outbox._thread.is_alive():
                self.outbox.flush(timeout=5.0)
            self.beat()  # the last word: DRAINING, so the controller stops scheduling at once
        self._hb_stop.set()
        self._hb_wake.set()
        if self._hb_thread is not None:
            self._hb_thread.join(5)
        self.outbox.stop()
        if self._metrics is not None:
            self._metrics.stop()
        self._write_status()
        if self.redis is not None:
            self.redis.close()
        self.client.close()
        log.info("agent stopped (exit %d)", self.exit_code)


def _validate_job(payload: dict[str, Any]) -> dict[str, Any]:
    job = dict(payload)
    if not isinstance(job.get("deployment_id"), str) or not job["deployment_id"]:
        raise CommandError("malformed run_job: missing 'deployment_id'")
    kind = job.setdefault("kind", "chat")
    if kind == "chat":
        msgs = job.get("messages")
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content", ""), str)
                for m in msgs
            )
        ):
            raise CommandError("malformed run_job: chat needs 'messages' [{role, content}]")
    elif kind == "completion":
        if not isinstance(job.get("prompt"), str):
            raise CommandError("malformed run_job: completion needs a 'prompt' string")
    else:
        raise CommandError(f"malformed run_job: kind must be 'chat' or 'completion', got {kind!r}")
    for key, default in (
        ("max_tokens", 256),
        ("temperature", 0.8),
        ("top_p", 0.95),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
    ):
        v = job.setdefault(key, default)
        if v is None:
            job[key] = default
        elif not isinstance(v, int | float) or isinstance(v, bool):
            raise CommandError(f"malformed run_job: {key!r} must be a number")
    stop = job.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise CommandError("malformed run_job: 'stop' must be a list of strings")
    job["stop"] = stop
    return job


def _cpu_threads() -> int:
    import os

    return os.cpu_count() or 1


def _redact(url: str) -> str:
    # redis://:password@host → redis://***@host: logs are shared in doctor bundles.
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
