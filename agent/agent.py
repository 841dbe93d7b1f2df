"""The Agent: one object composing config, identity, client, hardware, queue and runtime.

Threads, and why each exists:
- main: takes commands from the node's Redis queue and dispatches them (agent/dispatcher.py).
  Quick commands (run_job, cancel_job) run inline so a job reaches its primary with no extra hop;
  slow ones go to workers.
- control worker (1 thread): rpc_start / rpc_stop / load_primary / unload, serialised so a stop
  and a start, or a load and an unload, can never interleave.
- io worker: probe_links / rescan_models / fetch_model / hash_challenge (network and disk bound).
- heartbeat (agent/heartbeat.py): telemetry on the controller's interval; llama.cpp calls block,
  so it must not share a thread with anything that runs them.
- outbox (agent/outbox.py): sends reports in order, retrying until accepted; only then is a
  command acknowledged.

The parts talk back through the callbacks they are given here, never through this object.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Any

from agent import __version__, lifecycle
from agent.client import ControllerClient, controller_ca, trust_controller_ca
from agent.commands import Commands
from agent.config import AgentConfig
from agent.dispatcher import Dispatcher
from agent.envelope import CommandGuard
from agent.hardware import HardwareSource, hardware_source
from agent.heartbeat import HeartbeatLoop
from agent.identity import Identity, ensure_private_dir, load_identity, save_identity
from agent.lending import (
    LendingMonitor,
    LendingPolicy,
    LinuxIdleSource,
    PolicyError,
    check_caps,
    owner_policy_at_start,
)
from agent.metrics import MetricsServer
from agent.models import ShaCache, scan_models
from agent.outbox import Outbox
from agent.protocol import Hardware
from agent.redis_link import RedisLink
from agent.registry import DeploymentRegistry
from agent.runtime import RpcWorkerHandle, Runtime
from agent.runtime.llama import LlamaRuntime
from agent.state import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_REFUSED,
    AgentState,
    CommandError,
    FatalAgentError,
)

__all__ = [
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_REFUSED",
    "Agent",
    "AgentState",
    "CommandError",
    "FatalAgentError",
]

log = logging.getLogger("agent")


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
        self.runtime: Runtime = runtime if runtime is not None else LlamaRuntime()
        self.hw: HardwareSource = hardware or hardware_source(
            config.models_dir, config.state_dir, config.hardware_profile
        )
        # The controller's own CA (a LAN controller's, racon/tls.py), kept in the state dir.
        ca = controller_ca(config.state_dir, config.ca_file)
        trust_controller_ca(ca, config.state_dir)
        self.client = client or ControllerClient(config.controller_url, ca_file=ca)
        self.install_signals = install_signals
        self.identity: Identity | None = None
        self.hardware: Hardware | None = None
        self.exit_code = EXIT_OK
        self.revoked = False  # revoked or credential refused: nothing more can be reported
        self._state = AgentState.UNINITIALIZED
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._metrics: MetricsServer | None = None
        self.sha_cache = ShaCache(config.state_dir)
        self.registry = DeploymentRegistry()
        # An operator's --redis-url is kept as given; the controller's is asked again when it
        # goes stale (its Redis restarted elsewhere: agent/redis_link.py).
        self.redis = RedisLink(
            ca_file=ca, refresh=None if config.redis_url else self._redis_url_refresh
        )
        self.outbox = Outbox(
            self.client,
            on_revoked=self._on_revoked,
            on_credential_refused=self._on_credential_refused,
            refused=lambda: self.revoked,
        )
        self.heartbeat = HeartbeatLoop(
            config=config,
            client=self.client,
            hw=self.hw,
            registry=self.registry,
            state=lambda: self._state,
            node_id=lambda: self.node_id,
            rpc_worker=lambda: self.commands.rpc_worker,
            on_revoked=self._on_revoked,
            on_credential_refused=self._on_credential_refused,
            on_protocol_refused=lambda message: self._refused("protocol unsupported", message),
        )
        self.commands = Commands(
            config=config,
            registry=self.registry,
            runtime=self.runtime,
            client=self.client,
            outbox=self.outbox,
            hw=self.hw,
            sha_cache=self.sha_cache,
            redis_link=self.redis,
            node_id=lambda: str(self.node_id),
            command_key=lambda: self.identity.command_key_bytes() if self.identity else None,
            stop=self._stop,
            wake_heartbeat=self.heartbeat.wake,
            on_rpc_worker_started=self._on_rpc_worker_started,
            adopt_lending=self._adopt_policy,
        )
        self.lending = LendingMonitor(
            state_dir=config.state_dir,
            policy=lambda: self.config.lending,
            # Always there: an owner's policy from the UI may turn idle-only on (set_lending);
            # it is polled only while the policy asks for it.
            idle=LinuxIdleSource(),
            event=self.outbox.event,
            hand_off=lambda: lifecycle.hand_off_jobs(self.registry, self.redis, self.node_id),
        )
        self.dispatcher = Dispatcher(
            commands=self.commands,
            outbox=self.outbox,
            redis_link=self.redis,
            registry=self.registry,
            stop=self._stop,
            guard=CommandGuard(
                node_id=lambda: self.node_id,
                key=lambda: self.identity.command_key_bytes() if self.identity else None,
                max_age=config.command_max_age,
                state_dir=config.state_dir,
            ),
        )

    # --- state --------------------------------------------------------------------------------

    @property
    def state(self) -> AgentState:
        return self._state

    @property
    def node_id(self) -> str | None:
        return self.identity.node_id if self.identity else None

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat.interval

    @property
    def rpc_worker(self) -> RpcWorkerHandle | None:
        return self.commands.rpc_worker

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def telemetry(self) -> dict[str, Any]:
        return self.heartbeat.telemetry()

    def set_state(self, state: AgentState, why: str = "") -> None:
        with self._lock:
            if self._state == state:
                return
            old, self._state = self._state, state
        log.info("state %s → %s%s", old.value, state.value, f" ({why})" if why else "")
        if state == AgentState.READY:
            self._ready.set()
        else:
            self._ready.clear()
        self.heartbeat.wake()  # the controller should learn about it now, not in one interval

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def request_stop(self, reason: str = "stop requested", exit_code: int | None = None) -> None:
        if exit_code is not None and self.exit_code == EXIT_OK:
            self.exit_code = exit_code
        if not self._stop.is_set():
            log.info("stopping: %s", reason)
        self._stop.set()

    # --- run ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped (SIGTERM/SIGINT, revocation, or request_stop). Returns an exit code."""
        if self.install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.request_stop("SIGTERM: draining"))
            signal.signal(signal.SIGINT, lambda *_: self.request_stop("SIGINT: draining"))
        try:
            ensure_private_dir(self.config.state_dir)
            (self.config.state_dir / "logs").mkdir(parents=True, exist_ok=True)
            self._startup()
            if not self._stop.is_set():
                self.dispatcher.run()
        except FatalAgentError as exc:
            log.error("%s", exc)
            self.revoked = self.revoked or exc.refused
            self.exit_code = exc.exit_code
            self.set_state(AgentState.ERROR, str(exc))
        except Exception:
            log.exception("agent failed unexpectedly")
            self.exit_code = EXIT_ERROR
        finally:
            self._shutdown()
        return self.exit_code

    def _startup(self) -> None:
        self.set_state(AgentState.UNINITIALIZED, "discovering hardware")
        stored = load_identity(self.config.state_dir)
        resumable = stored is not None and stored.controller_url == self.config.controller_url
        if stored is not None and resumable:
            self._adopt(stored)
            resumable = lifecycle.credential_still_valid(self.client, self.config)
            if not resumable:
                self.identity = None
        if resumable and self.identity is not None and not self.identity.command_key:
            # Stored before commands were signed: ask for the key before any command is taken.
            self._adopt(lifecycle.command_key_fetch(self.client, self.identity, self.config))
        if resumable:
            self.heartbeat.start()  # the controller sees UNINITIALIZED → REGISTERING → READY
        self.hardware = self.hw.inventory(benchmark=self.config.run_benchmarks)
        try:
            self.config.lending, saved = owner_policy_at_start(
                self.config.state_dir, self.config.lending, hardware=dict(self.hardware)
            )
            check_caps(self.config.lending, dict(self.hardware))
        except PolicyError as exc:
            raise FatalAgentError(f"lending policy: {exc}", EXIT_CONFIG) from None
        if saved:
            log.info("lending: the policy the owner set in the controller's UI (%s)", saved)
        models = scan_models(self.config.models_dir, self.sha_cache)
        self.set_state(AgentState.REGISTERING, "handshake with the controller")
        if resumable:
            log.info("resuming as node %s (stored credential)", self.node_id)
            # Hardware may have changed since enrollment (RAM added, GPU swapped).
            self.outbox.event(
                "HARDWARE_UPDATED",
                "hardware inventory at agent start",
                {
                    "hardware": self.hardware,
                    "models": models,
                    "agent_version": __version__,
                    "lending": self.config.lending.to_wire(),
                },
            )
        else:
            if stored is not None:
                log.info(
                    "stored credential is for %s; enrolling with %s",
                    stored.controller_url,
                    self.config.controller_url,
                )
            enrolled = lifecycle.enroll(
                self.client,
                self.config,
                hardware=self.hardware,
                models=models,
                stored=stored,
                stop=self._stop,
            )
            if enrolled is None:
                return
            identity, resp = enrolled
            self._adopt(identity)
            interval = resp.get("heartbeat_interval") or self.heartbeat.interval
            self.heartbeat.interval = float(interval)
            self.heartbeat.start()
        assert self.identity is not None
        lifecycle.announce_start(self.outbox, self.registry)
        self.redis.connect(self.identity.node_id, self._stop)
        self.outbox.start()
        self._metrics = lifecycle.start_metrics(self.config, self.heartbeat.snapshot, self.outbox)
        for left in self.hw.devices_left_out:
            self.outbox.event(
                "GPU_DEVICE_LEFT_OUT",
                f"{left.name} ({left.description}) is not lent: it {left.reason}",
                {"device": left.name, "description": left.description, "reason": left.reason},
            )
        self.lending.start()
        self.set_state(
            *lifecycle.runtime_checks(self.runtime, self.config, self.commands, self.outbox)
        )

    def _redis_url_refresh(self) -> str:
        """The node's Redis URL from the controller now, kept in the stored identity too."""
        url = self.client.redis_url()
        if self.identity is not None and url != self.identity.redis_url:
            self.identity = dataclasses.replace(self.identity, redis_url=url)
            save_identity(self.config.state_dir, self.identity)
        return url

    def _adopt(self, identity: Identity) -> None:
        self.identity = identity
        self.client.set_credentials(identity.node_id, identity.credential)
        self.redis.url = self.config.redis_url or identity.redis_url

    # --- callbacks from the parts ---------------------------------------------------------------

    def _adopt_policy(self, policy: LendingPolicy) -> None:
        """The owner's policy from the controller (set_lending) replaces the file's; it is kept
        in the state dir across restarts (agent/lending.py: owner_policy_at_start)."""
        check_caps(policy, dict(self.hardware or {}))
        self.config.lending = policy

    def _on_rpc_worker_started(self) -> None:
        if self._state == AgentState.DEGRADED:
            self.set_state(AgentState.READY, "RPC worker started")

    def _on_revoked(self, exc: Exception) -> None:
        self._refused("node revoked", f"{exc} — this node can no longer serve; stopping")

    def _on_credential_refused(self, exc: Exception) -> None:
        self._refused(
            "credential refused",
            f"the controller no longer accepts this node's credential ({exc}); delete "
            f"{self.config.identity_path} and restart with --enrollment-token to enroll again",
        )

    def _refused(self, why: str, message: str) -> None:
        """The controller refused this node: nothing more can be reported, so stop."""
        if self.revoked:
            return
        self.revoked = True
        log.error("%s", message)
        self.set_state(AgentState.ERROR, why.removeprefix("node "))
        self.request_stop(why, EXIT_REFUSED)

    # --- drain and shutdown -------------------------------------------------------------------

    def _shutdown(self) -> None:
        revoked = self.revoked
        if self._state != AgentState.ERROR:
            self.set_state(AgentState.DRAINING, "shutting down")
        finished_before = self.registry.counters["jobs_finished_total"]
        cancelled = lifecycle.drain(self.config, self.registry, self.commands, wait=not revoked)
        self.commands.finished.stop()  # the reports still held go to the outbox, flushed below
        self.dispatcher.shutdown()
        self.commands.stop_rpc_worker()
        if self.identity is not None and not revoked:
            finished = self.registry.counters["jobs_finished_total"] - finished_before
            self.outbox.event(
                "NODE_DRAINED",
                "agent drained and stopping",
                {"jobs_finished_during_drain": finished, "jobs_cancelled": cancelled},
            )
            if self.outbox.running:
                self.outbox.flush(timeout=5.0)
            self.heartbeat.beat()  # the last word: DRAINING, so the controller stops scheduling
        self.lending.stop()
        self.heartbeat.stop()
        self.outbox.stop()
        if self._metrics is not None:
            self._metrics.stop()
        self.heartbeat.write_status()
        self.redis.close()
        self.client.close()
        log.info("agent stopped (exit %d)", self.exit_code)
