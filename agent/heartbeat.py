"""The heartbeat thread: telemetry to the controller on its interval, and the local status file.

llama.cpp calls block, so the heartbeat has a thread of its own: a node busy loading a model
still tells the controller it is alive.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agent import __version__
from agent.client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailable,
    NodeRevoked,
    ProtocolUnsupported,
    Unauthorized,
)
from agent.config import AgentConfig
from agent.hardware import HardwareSource
from agent.identity import write_private_file
from agent.protocol import PROTOCOL_VERSION, Heartbeat, controller_protocol_refusal
from agent.registry import DeploymentRegistry
from agent.runtime import RpcWorkerHandle
from agent.state import AgentState

log = logging.getLogger("agent")

Refusal = Callable[[Exception], None]


class HeartbeatLoop:
    def __init__(
        self,
        *,
        config: AgentConfig,
        client: ControllerClient,
        hw: HardwareSource,
        registry: DeploymentRegistry,
        state: Callable[[], AgentState],
        node_id: Callable[[], str | None],
        rpc_worker: Callable[[], RpcWorkerHandle | None],
        on_revoked: Refusal,
        on_credential_refused: Refusal,
        on_protocol_refused: Callable[[str], None],
    ) -> None:
        self.config = config
        self.client = client
        self.hw = hw
        self.registry = registry
        self.state = state
        self.node_id = node_id
        self.rpc_worker = rpc_worker
        self.on_revoked = on_revoked
        self.on_credential_refused = on_credential_refused
        # Either side refused the other's node protocol: the agent stops (message names both).
        self.on_protocol_refused = on_protocol_refused
        self.interval = 5.0  # the controller's figure replaces it with each answer
        self.controller_state: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Beat now rather than at the end of the interval (a state or deployment changed)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.beat()
            self.write_status()
            deadline = time.monotonic() + self.interval
            while not self._stop.is_set() and not self._wake.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(left, 1.0))

    def beat(self) -> None:
        hb = Heartbeat(
            state=self.state().value,
            sent_at=time.time(),
            protocol_version=PROTOCOL_VERSION,
            telemetry=self.telemetry(),
        )
        try:
            resp = self.client.heartbeat(hb)
        except NodeRevoked as exc:
            self.on_revoked(exc)
            return
        except Unauthorized as exc:
            self.on_credential_refused(exc)
            return
        except ControllerUnavailable:
            return  # logged once per outage by the client
        except ProtocolUnsupported as exc:
            self.on_protocol_refused(f"the controller refused this agent's heartbeat: {exc}")
            return
        except ControllerError as exc:
            log.warning("heartbeat rejected: %s", exc)
            return
        theirs = resp.get("protocol_version", 1)
        if isinstance(theirs, bool) or not isinstance(theirs, int):
            refusal: str | None = f"protocol_version {theirs!r} is not a protocol version"
        else:
            refusal = controller_protocol_refusal(theirs, agent_version=__version__)
        if refusal:
            self.on_protocol_refused(f"heartbeat answer: {refusal}")
            return
        interval = resp.get("heartbeat_interval")
        if isinstance(interval, int | float) and 0.2 <= interval <= 3600:
            self.interval = float(interval)
        state = resp.get("state")
        if state and state != self.controller_state:
            log.info("controller lists this node as %s", state)
            self.controller_state = str(state)

    def telemetry(self) -> dict[str, Any]:
        t = dict(self.hw.telemetry())
        t.update(self.registry.telemetry())
        rw = self.rpc_worker()
        t["rpc_worker"] = {
            "running": bool(rw and rw.running),
            "endpoint": self.config.rpc_endpoint if self.config.rpc_worker else None,
        }
        t["agent_version"] = __version__
        return t

    def snapshot(self) -> dict[str, Any]:
        """What status.json and the metrics endpoint show."""
        t = self.telemetry()
        return {
            "models_loaded": self.registry.models_loaded(),
            "last_job": self.registry.last_job(),
            "state": self.state().value,
            "controller_state": self.controller_state,
            "node_id": self.node_id(),
            "node_name": self.config.node_name,
            "controller_url": self.config.controller_url,
            "controller_reachable": self.client.reachable,
            "updated_at": time.time(),
            **t,
            **self.registry.counters,
        }

    def write_status(self) -> None:
        try:
            write_private_file(
                self.config.status_path, json.dumps(self.snapshot(), indent=2) + "\n"
            )
        except OSError:
            pass
