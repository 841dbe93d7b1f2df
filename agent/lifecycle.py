"""The agent's start and end: the stored credential or enrollment, runtime checks, metrics, drain.

These are steps the Agent runs in order (agent/agent.py); each takes only the parts it uses.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
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
from agent.commands import Commands
from agent.config import AgentConfig
from agent.identity import Identity, machine_id, save_identity
from agent.metrics import MetricsServer, Snapshot, start_metrics_server
from agent.outbox import Outbox
from agent.protocol import (
    PROTOCOL_VERSION,
    EnrollRequest,
    EnrollResponse,
    Hardware,
    Heartbeat,
    PublicAddressError,
    controller_protocol_refusal,
    is_private_address,
)
from agent.redis_link import RedisLink
from agent.registry import DeploymentRegistry
from agent.retry import RetryStopped, retry_call
from agent.runtime import Runtime, RuntimeErrorReport
from agent.runtime.stream import append_error
from agent.state import EXIT_CONFIG, EXIT_REFUSED, AgentState, FatalAgentError

log = logging.getLogger("agent")


def credential_still_valid(client: ControllerClient, config: AgentConfig) -> bool:
    """One synchronous beat before trusting a stored credential.

    A controller whose database was reset no longer knows us: with a token at hand we enroll
    again instead of stopping. Revocation is final either way. An unreachable controller
    proves nothing, so we keep the credential and let the heartbeat thread retry.
    """
    hb = Heartbeat(state=AgentState.UNINITIALIZED.value, sent_at=time.time(), telemetry={})
    try:
        client.heartbeat(hb)
    except NodeRevoked as exc:
        raise FatalAgentError(
            f"{exc} — this node can no longer serve", EXIT_REFUSED, refused=True
        ) from None
    except Unauthorized as exc:
        if not config.enrollment_token:
            raise FatalAgentError(
                f"the controller no longer accepts the stored credential ({exc}); restart "
                "with --enrollment-token to enroll again",
                EXIT_REFUSED,
                refused=True,
            ) from None
        log.warning("stored credential refused (%s); enrolling again with the token", exc)
        return False
    except (ControllerUnavailable, ControllerError):
        pass
    return True


def command_key_fetch(
    client: ControllerClient, identity: Identity, config: AgentConfig
) -> Identity:
    """An identity stored before commands were signed gets its command key from one heartbeat
    answer (asked with the node's credential) and keeps it. Without one every command is
    refused; the agent says so and runs on, and asks again at its next start."""
    hb = Heartbeat(
        state=AgentState.UNINITIALIZED.value, sent_at=time.time(), telemetry={},
        want_command_key=True,
    )  # fmt: skip
    try:
        key = str(client.heartbeat(hb).get("command_key") or "")
    except (ControllerUnavailable, ControllerError) as exc:
        log.warning("could not fetch this node's command key (%s): commands are refused", exc)
        return identity
    updated = dataclasses.replace(identity, command_key=key)
    if updated.command_key_bytes() is None:
        log.warning("the controller gave no command key: every command will be refused")
        return identity
    save_identity(config.state_dir, updated)
    log.info("fetched this node's command key (kept in %s)", config.identity_path)
    return updated


def controller_protocol_accepted(client: ControllerClient, *, stop: threading.Event) -> bool:
    """Read the controller's protocol version (GET, no token sent) and refuse one this agent
    does not speak before the token is ever presented, so the refusal leaves it unused.

    Retries an unreachable controller until `stop` (then False). A controller without the
    endpoint (404) predates it and speaks protocol 1.
    """
    try:
        info = retry_call(
            lambda: client.protocol(retries=0),
            retry_on=ControllerUnavailable,
            base=1.0,
            cap=30.0,
            stop=stop,
        )
        theirs = info["protocol_version"]
    except RetryStopped:
        return False
    except ControllerError as exc:
        if exc.status != 404:
            raise FatalAgentError(
                f"reading the controller's protocol version failed: {exc}", EXIT_REFUSED
            ) from None
        theirs = 1
    refusal = controller_protocol_refusal(theirs, agent_version=__version__)
    if refusal:
        raise FatalAgentError(
            f"{refusal} (the enrollment token was not used)", EXIT_REFUSED, refused=True
        )
    return True


def enroll(
    client: ControllerClient,
    config: AgentConfig,
    *,
    hardware: Hardware,
    models: list[Any],
    stored: Identity | None,
    stop: threading.Event,
) -> tuple[Identity, EnrollResponse] | None:
    """Enroll with the token, retrying an unreachable controller until `stop` (then None).

    A stored credential is presented too, since the controller lets an enrolled machine
    re-enroll only with its node's current credential. The new identity is saved.
    """
    token = config.enrollment_token
    if not token:
        raise FatalAgentError(
            f"no stored credential in {config.state_dir} and no --enrollment-token "
            "(or RACON_ENROLLMENT_TOKEN): ask an administrator for a token",
            EXIT_CONFIG,
        )
    req = EnrollRequest(
        token=token,
        node_name=config.node_name,
        machine_id=machine_id(config.state_dir),
        agent_version=__version__,
        advertise_address=config.advertise_address,
        rpc_port=config.rpc_port,
        hardware=hardware,
        models=models,
        protocol_version=PROTOCOL_VERSION,
        lending=config.lending.to_wire(),
    )
    presented = (stored.node_id, stored.credential) if stored else None
    if stop.is_set():
        return None
    if not controller_protocol_accepted(client, stop=stop):
        return None
    try:
        # The client logs an outage once; keep trying with capped backoff.
        resp = retry_call(
            lambda: client.enroll(req, retries=0, presented=presented),
            retry_on=ControllerUnavailable,
            base=1.0,
            cap=30.0,
            stop=stop,
        )
    except RetryStopped:
        return None
    except (NodeRevoked, Unauthorized) as exc:
        raise FatalAgentError(
            f"enrollment refused by the controller: {exc}", EXIT_REFUSED
        ) from None
    except ProtocolUnsupported as exc:
        raise FatalAgentError(
            f"the controller refused this agent's protocol (the token was not used): {exc}",
            EXIT_REFUSED,
            refused=True,
        ) from None
    except ControllerError as exc:
        raise FatalAgentError(f"enrollment failed: {exc}", EXIT_REFUSED) from None
    # Checked before enrolling too; this guards a controller replaced in between.
    refusal = controller_protocol_refusal(
        int(resp.get("protocol_version", 1)), agent_version=__version__
    )
    if refusal:
        raise FatalAgentError(refusal, EXIT_REFUSED, refused=True)
    identity = Identity(
        node_id=str(resp["node_id"]),
        credential=str(resp["credential"]),
        controller_url=config.controller_url,
        redis_url=str(resp["redis_url"]),
        node_name=config.node_name,
        command_key=str(resp.get("command_key") or ""),
    )
    if identity.command_key_bytes() is None:
        log.warning("the controller gave no command key: every command will be refused")
    save_identity(config.state_dir, identity)
    log.info("enrolled as node %s (%s)", identity.node_id, config.node_name)
    return identity, resp


def announce_start(outbox: Outbox, registry: DeploymentRegistry) -> None:
    """The first report of this agent process: AGENT_STARTED with the deployments it holds.

    Its primaries and RPC worker died with the process before it (they are its children), and
    nothing is reloaded on start, so the list is what is loaded now (empty at start). The
    controller fails and replaces the deployments on this node it believed served that are not
    in it, instead of routing jobs here that would end ``deployment_not_loaded``. Queued before
    the outbox starts, so it goes ahead of any load result of this process.
    """
    held = registry.telemetry()
    outbox.event(
        "AGENT_STARTED",
        f"agent {__version__} started holding {len(held['primaries'])} deployment(s)",
        {"deployments": held["primaries"], "loading": held["loading"]},
    )


def runtime_checks(
    runtime: Runtime, config: AgentConfig, commands: Commands, outbox: Outbox
) -> tuple[AgentState, str]:
    """The state the runtime allows (READY, DEGRADED or ERROR), and why."""
    ok, detail = runtime.check()
    if not ok:
        outbox.fault(f"runtime check failed: {detail}", fatal=True)
        return AgentState.ERROR, detail
    log.info("runtime: %s", detail)
    if not config.rpc_worker:
        return AgentState.READY, "runtime checks passed (no RPC worker)"
    try:
        commands.start_rpc_worker()
    except PublicAddressError as exc:
        return AgentState.ERROR, str(exc)
    except RuntimeErrorReport as exc:
        outbox.fault(str(exc), fatal=False)
        return AgentState.DEGRADED, str(exc)
    return AgentState.READY, "runtime checks passed"


def start_metrics(config: AgentConfig, snapshot: Snapshot, outbox: Outbox) -> MetricsServer | None:
    if config.metrics_port is None:
        return None
    # Same rule as ggml-rpc: never listen on a public address.
    host = config.advertise_address
    host = host if is_private_address(host) else "127.0.0.1"
    # A taken port is reported and the agent runs on without metrics (not a node fault).
    server, problem = start_metrics_server(host, config.metrics_port, snapshot)
    if problem:
        outbox.event(
            "METRICS_UNAVAILABLE",
            f"metrics port {config.metrics_port} not served: {problem}",
            {"port": config.metrics_port},
        )
    return server


def drain(
    config: AgentConfig, registry: DeploymentRegistry, commands: Commands, *, wait: bool
) -> list[str]:
    """Let running jobs finish within the drain bound (when `wait`), cancel the rest, stop every
    deployment and end the jobs still waiting for a load. Returns the cancelled job ids."""
    if wait:
        deadline = time.monotonic() + config.drain_seconds
        while registry.running_jobs() and time.monotonic() < deadline:
            time.sleep(0.05)
    remaining = registry.running_jobs()
    deployments = registry.all()
    cancelled: list[str] = []
    for job_id, dep_id in remaining:
        cancelled.append(job_id)
        dep = registry.get(dep_id)
        if dep is not None and dep.primary is not None:
            dep.primary.cancel(job_id)
    if remaining:
        log.info("drain bound reached: cancelling %d job(s)", len(remaining))
        end = time.monotonic() + 3.0
        while registry.running_jobs() and time.monotonic() < end:
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
            commands.fail_job(
                job["job_id"], "agent shut down before the deployment loaded", cancelled=True
            )
    return cancelled


def hand_off_jobs(
    registry: DeploymentRegistry, redis_link: RedisLink, node_id: str | None
) -> list[str]:
    """A pause with the failover handoff: end each running job's attempt here with the
    ``node_paused`` code, which the controller's follower fails over to another replica.

    The job's own writer writes that end (PrimaryHandle.hand_off), after the chunks it wrote and
    with its attempt's number: an end appended from this thread could take the seq of a chunk
    the job thread was writing at that moment (the reader then sees a gap) or carry the wrong
    attempt. A job no primary runs yet (waiting for its deployment's load) gets the end
    appended here. Returns the job ids."""
    message = "the node's owner paused lending"
    handed: list[str] = []
    for job_id, dep_id in registry.running_jobs():
        dep = registry.get(dep_id)
        primary = dep.primary if dep is not None else None
        try:
            if primary is not None and primary.hand_off(job_id, message, code="node_paused"):
                handed.append(job_id)
                continue
            r = redis_link.client
            if r is None or node_id is None:
                continue
            waiting = [j for j in (dep.pending if dep is not None else []) if j["job_id"] == job_id]
            attempt = int(waiting[0].get("attempt") or 1) if waiting else 1
            append_error(r, job_id, message, node_id=node_id, code="node_paused", attempt=attempt)
            handed.append(job_id)
        except Exception as exc:  # redis errors: the job then finishes here instead
            log.warning("job %s: cannot hand off: %s", job_id, exc)
    return handed
