"""What the desktop app knows and does, without Tauri: find the local agent, pause and resume it
the way ``node-agent pause`` / ``resume`` do (through its state directory), and read and set this
node's figures on the controller with the node's own credential (/api/agent/self, /earnings,
/lending). Never Redis.

Where the agent is: ``--state-dir``, else ``RACON_STATE_DIR``, else a joined machine's
``~/.local/state/racon-agent``, else ``make run``'s local agents (``var/agents/local-N`` in this
checkout, or ``RACON_VAR_DIR/agents``, racon/launcher.py).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from agent.cli import read_pid
from agent.config import default_state_dir
from agent.identity import IdentityError, load_identity, write_private_file
from agent.lending import HANDOFFS, lending_status_path, pause_path, read_json

CHECKOUT = Path(__file__).resolve().parents[2]
STATES = ("READY", "BUSY", "DRAINING", "PAUSED", "OFFLINE")


def candidate_state_dirs(env: Mapping[str, str], explicit: Path | None = None) -> list[Path]:
    if explicit is not None:
        return [explicit]
    if env.get("RACON_STATE_DIR"):
        return [Path(env["RACON_STATE_DIR"]).expanduser()]
    out = [default_state_dir(env)]
    var = Path(env.get("RACON_VAR_DIR") or CHECKOUT / "var")
    out += sorted((var / "agents").glob("local-*"))
    return out


def find_state_dir(env: Mapping[str, str], explicit: Path | None = None) -> Path | None:
    """The first candidate holding an enrolled identity (None: no agent on this machine)."""
    for d in candidate_state_dirs(env, explicit):
        if (d / "identity.json").is_file():
            return d
    return None


class AgentError(RuntimeError):
    """Said to the owner as is."""


@dataclass
class LocalAgent:
    state_dir: Path

    def identity(self) -> Any:
        try:
            ident = load_identity(self.state_dir)
        except IdentityError as exc:
            raise AgentError(f"the agent's identity is unreadable: {exc}") from exc
        if ident is None:
            raise AgentError(f"no node is enrolled in {self.state_dir}")
        return ident

    def pid(self) -> int | None:
        return read_pid(self.state_dir / "agent.pid")

    def lending(self) -> dict[str, Any]:
        return read_json(lending_status_path(self.state_dir)) or {}

    def status(self) -> dict[str, Any]:
        return read_json(self.state_dir / "status.json") or {}

    def _await(self, *, paused: bool, request: str | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.lending()
            if bool(st.get("paused")) == paused and (
                request is None or st.get("request") == request
            ):
                return True
            time.sleep(0.05)
        return False

    def pause(self, handoff: str | None = None, timeout: float = 10.0) -> str:
        """``node-agent pause``: a pause request in the state dir; the agent turns DRAINING and
        hands its running jobs over (or finishes them, as the policy or ``handoff`` says)."""
        if handoff is not None and handoff not in HANDOFFS:
            raise AgentError(f"handoff: {handoff!r} is not one of {', '.join(HANDOFFS)}")
        pid = self.pid()
        if pid is None:
            raise AgentError(f"the agent is not running ({self.state_dir}): nothing to pause")
        request = uuid.uuid4().hex
        body = {"id": request, "handoff": handoff, "at": time.time()}
        write_private_file(pause_path(self.state_dir), json.dumps(body) + "\n")
        if not self._await(paused=True, request=request, timeout=timeout):
            raise AgentError(f"the agent (pid {pid}) did not confirm the pause in {timeout:.0f}s")
        return f"lending paused (handoff: {self.lending().get('handoff')}); the node is draining"

    def resume(self, timeout: float = 10.0) -> str:
        if self.pid() is None:
            raise AgentError(f"the agent is not running ({self.state_dir}): nothing to resume")
        pause_path(self.state_dir).unlink(missing_ok=True)
        if not self._await(paused=False, request=None, timeout=timeout):
            raise AgentError(f"still paused: {self.lending().get('reason') or 'no confirmation'}")
        return "lending resumed"


class ControllerError(RuntimeError):
    def __init__(self, message: str, *, status: int = 0, field: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.field = field


class Controller:
    """The controller's REST API with the node's credential; ``base`` is its origin."""

    def __init__(self, base: str, auth: str, *, verify: Any = True, timeout: float = 10) -> None:
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ControllerError(f"controller URL {base!r} is not an http(s) URL")
        self.base = f"{parts.scheme}://{parts.netloc}"
        self._client = httpx.Client(
            base_url=self.base, headers={"Authorization": auth}, verify=verify, timeout=timeout
        )

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = self._client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ControllerError(f"controller unreachable at {self.base}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                err = resp.json().get("error") or {}
            except ValueError:
                err = {}
            raise ControllerError(
                str(err.get("message") or f"HTTP {resp.status_code} from {path}"),
                status=resp.status_code,
                field=str(err.get("field") or ""),
            )
        return resp.json()

    def node(self) -> dict[str, Any]:
        return dict(self._call("GET", "/api/agent/self"))

    def earnings(self, days: int = 30) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/agent/earnings", params={"days": days}))

    def lending(self) -> dict[str, Any]:
        return dict(self._call("GET", "/api/agent/lending"))

    def set_lending(self, form: Mapping[str, str]) -> dict[str, Any]:
        return dict(self._call("PUT", "/api/agent/lending", json=dict(form)))

    def close(self) -> None:
        self._client.close()


def controller_for(agent: LocalAgent, override: str | None = None) -> Controller:
    ident = agent.identity()
    verify: Any = True
    ca = agent.state_dir / "controller-ca.pem"
    # The join line keeps the controller's CA beside the agent it installs (join.sh, join.py).
    joined_ca = Path(os.environ.get("RACON_JOIN_HOME") or Path.home() / ".racon-agent")
    joined_ca = joined_ca / "controller-ca.pem"
    if ca.is_file():
        verify = str(ca)
    elif os.environ.get("RACON_CA_FILE"):
        verify = os.environ["RACON_CA_FILE"]
    elif joined_ca.is_file():
        verify = str(joined_ca)
    return Controller(override or ident.controller_url, ident.auth_header(), verify=verify)


def earnings_series(rows: list[dict[str, Any]], *, days: int, today: Any) -> dict[str, Any]:
    """Per day, oldest first, over ``days`` days ending ``today`` (a date): credits (micro) and
    jobs summed over the rows; days without a row are 0."""
    by_day: dict[str, list[int]] = {}
    for r in rows:
        acc = by_day.setdefault(str(r["day"]), [0, 0])
        acc[0] += int(r["credits"])
        acc[1] += int(r["jobs"])
    out_days, credits, jobs = [], [], []
    for i in range(days - 1, -1, -1):
        d = (today - timedelta(days=i)).isoformat()
        out_days.append(d)
        c, j = by_day.get(d, [0, 0])
        credits.append(c)
        jobs.append(j)
    return {"days": out_days, "credits": credits, "jobs": jobs}
