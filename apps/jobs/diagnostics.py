"""The controller's half of a node's troubleshooting bundle (the agent's is `node-agent doctor --bundle`).

The operator docs: "When diagnosing a node, capture its agent version, controller version, node
state, recent events and whether failure occurs before or during execution." The bundle holds
exactly that, plus hardware, the last errors and reachability, and never a secret: bundles get
attached to bug reports, so every value passes through ``scrub`` on its way in.

It lives in jobs, not nodes: a node's bundle holds its jobs and deployments, and nodes sits below
jobs.
"""

from __future__ import annotations

import io
import json
import platform
import re
import socket
import tarfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import django
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import Q

import racon
from agent.protocol import (
    HEARTBEATS_ZSET,
    PROTOCOL_VERSION,
    heartbeat_key,
    node_processing_key,
    node_queue_key,
)
from apps.nodes.models import Event, Node
from apps.nodes.states import UNHEALTHY
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis

from .models import Deployment, Job

RECENT_EVENTS = 200
RECENT_JOBS = 50
RECENT_ERRORS = 50
RPC_PROBE_TIMEOUT = 1.0
REDACTED = "[redacted]"

# A key whose name says it holds a secret: its value is replaced whatever it is.
SECRET_NAME = re.compile(
    r"token|secret|credential|passw|api[_-]?key|^key$|_key$|authorization|cookie|session", re.I
)
# ...except token counts (prompt_tokens, tokens_per_s, max_tokens), which are no secret.
COUNT_NAME = re.compile(r"tokens|token_count", re.I)
# Plaintexts RACoN issues (API keys rk_, enrollment tokens rcn_, node credentials rnc_), and the
# password of a URL: caught even inside free text such as an error message.
SECRET_TEXT = re.compile(r"\b(?:rk|rcn|rnc)_[A-Za-z0-9_\-]{12,}")
URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@", re.I
)
# Settings whose values must never appear anywhere in a bundle.
SECRET_SETTINGS = (
    "SECRET_KEY",
    "NODE_ENROLLMENT_SECRET",
    "AI_API_KEY",
    "METRICS_TOKEN",
    "RACON_RECEIPT_KEY",
)

# Event kinds that report a failure (besides any kind naming one, see _error_event_q).
ERROR_KINDS = frozenset(
    {
        "COMMAND_FAILED",
        "NODE_FAULT",
        "HEARTBEAT_TIMEOUT",
        "PUBLIC_IP_VIOLATION",
        "NODE_LOST_BEFORE_EXECUTION",
    }
)
_ERROR_WORDS = ("FAIL", "FAULT", "ERROR", "TIMEOUT", "VIOLATION", "LOST", "REFUSED", "CRASH")


class UnknownNode(LookupError):
    """No node (or more than one) answers to the name or id given."""


@dataclass(frozen=True)
class NodeDiagnostics:
    """A bundle and the summary printed beside it."""

    node_id: NodeId
    node_name: str
    data: bytes
    summary: str


# --- selectors -----------------------------------------------------------------------------------


def node_resolve(*, ref: str) -> Node:
    """The node named ``ref`` (id, id prefix of 8+ characters, or exact name); UnknownNode otherwise."""
    ref = ref.strip()
    if not ref:
        raise UnknownNode("give a node name or id")
    try:
        node = Node.objects.filter(pk=uuid.UUID(ref)).first()
    except ValueError:
        node = None
    if node is not None:
        return node
    by_name = list(Node.objects.filter(name=ref)[:5])
    if len(by_name) == 1:
        return by_name[0]
    if len(by_name) > 1:
        ids = ", ".join(str(n.id) for n in by_name)
        raise UnknownNode(f"{len(by_name)} nodes are named {ref!r} ({ids}); give the id instead")
    if len(ref) >= 8 and re.fullmatch(r"[0-9a-fA-F-]+", ref):
        by_prefix = _nodes_by_id_prefix(ref)
        if len(by_prefix) == 1:
            return by_prefix[0]
    raise UnknownNode(f"no node named or with id {ref!r}; `GET /api/admin/nodes` lists them")


def _nodes_by_id_prefix(prefix: str) -> list[Node]:
    # UUID columns are not text on every backend (PostgreSQL), so match in Python over the ids
    # alone: the registry is thousands of rows at most, and this is an operator's one-off lookup.
    p = prefix.lower().replace("-", "")
    ids = [i for i in Node.objects.values_list("id", flat=True) if i.hex.startswith(p)]
    return list(Node.objects.filter(pk__in=ids)) if len(ids) == 1 else []


def node_diagnostics(*, node_id: NodeId, now: datetime) -> NodeDiagnostics:
    """Collect, scrub and pack a node's bundle (UnknownNode when the id names no node)."""
    try:
        node = Node.objects.filter(pk=node_id).first()
    except (ValueError, ValidationError):
        node = None
    if node is None:
        raise UnknownNode(f"no node with id {node_id}")
    files = _collect(node=node, now=now)
    summary = _summary(files)
    files["summary.txt"] = summary
    return NodeDiagnostics(
        node_id=ids.node_id(node.id),
        node_name=node.name,
        data=_pack(files, now=now),
        summary=summary,
    )


def node_diagnostics_bundle(*, node_id: NodeId, now: datetime) -> bytes:
    """The node's bundle as a tar.gz: versions, state history, events, hardware, errors, jobs, reachability."""
    return node_diagnostics(node_id=node_id, now=now).data


# --- collection ----------------------------------------------------------------------------------


def _collect(*, node: Node, now: datetime) -> dict[str, Any]:
    telemetry = _telemetry(ids.node_id(node.id))
    files: dict[str, Any] = {}
    files["versions.json"] = {
        "controller_version": racon.__version__,
        "agent_version": node.agent_version or None,
        "agent_version_reported_live": telemetry.get("agent_version"),
        "protocol_version": PROTOCOL_VERSION,
        "python": platform.python_version(),
        "django": _django_version(),
        "database": _db_vendor(),
    }
    files["node.json"] = {
        "id": str(node.id),
        "name": node.name,
        "state": node.state,
        "state_changed_at": node.state_changed_at,
        "address": node.address,
        "rpc_port": node.rpc_port,
        "agent_version": node.agent_version,
        "account_id": str(node.account_id),
        "enrolled_at": node.enrolled_at,
        "revoked_at": node.revoked_at,
        "drain_requested": node.drain_requested,
        "last_heartbeat_at_db": node.last_heartbeat_at,
    }
    history = (
        Event.objects.filter(node=node)
        .exclude(new_state="")
        .order_by("-created_at", "-id")[:RECENT_EVENTS]
    )
    files["state_history.json"] = [
        {
            "at": e.created_at,
            "from": e.old_state,
            "to": e.new_state,
            "kind": e.kind,
            "message": e.message,
        }
        for e in reversed(list(history))
    ]
    events = list(Event.objects.filter(node=node).order_by("-created_at", "-id")[:RECENT_EVENTS])
    files["events.json"] = [_event(e) for e in events]
    files["hardware.json"] = {
        "inventory": node.hardware,
        "summary": {
            "cpu_model": node.cpu_model,
            "cpu_physical_cores": node.cpu_physical_cores,
            "cpu_logical_cores": node.cpu_logical_cores,
            "ram_total": node.ram_total,
            "ram_available": node.ram_available,
            "vram_total": node.vram_total,
            "vram_free": node.vram_free,
            "gpu_count": node.gpu_count,
            "disk_free": node.disk_free,
            "gflops": node.gflops,
            "mem_bandwidth_gbps": node.mem_bandwidth_gbps,
        },
        "telemetry": telemetry,
    }
    jobs = list(
        Job.objects.filter(Q(nodes=node) | Q(deployment__primary=node))
        .distinct()
        .select_related("model")
        .order_by("-queued_at")[:RECENT_JOBS]
    )
    files["jobs.json"] = [_job(j, node_id=ids.node_id(node.id)) for j in jobs]
    error_events = [
        e
        for e in Event.objects.filter(node=node)
        .filter(_error_event_q())
        .order_by("-created_at", "-id")[:RECENT_ERRORS]
    ]
    failed_jobs = [j for j in jobs if j.error and j.state == "FAILED"]
    files["errors.json"] = {
        "events": [_event(e) for e in error_events],
        "jobs": [_job(j, node_id=ids.node_id(node.id)) for j in failed_jobs],
    }
    files["deployments.json"] = [
        {
            "id": str(d.id),
            "model": d.model.name,
            "state": d.state,
            "primary": str(d.primary_id) == str(node.id),
            "created_at": d.created_at,
            "ready_at": d.ready_at,
            "stopped_at": d.stopped_at,
            "error": d.error,
        }
        for d in Deployment.objects.filter(nodes=node)
        .select_related("model")
        .order_by("-created_at")[:20]
    ]
    files["reachability.json"] = _reachability(node, now=now)
    return files


def _error_event_q() -> Q:
    q = Q(kind__in=ERROR_KINDS) | Q(new_state__in=UNHEALTHY)
    for word in _ERROR_WORDS:
        q |= Q(kind__contains=word)
    return q


def _event(e: Event) -> dict[str, Any]:
    return {
        "id": e.id,
        "at": e.created_at,
        "kind": e.kind,
        "category": e.category,
        "old_state": e.old_state,
        "new_state": e.new_state,
        "message": e.message,
        "job_id": e.job_id,
        "deployment_id": e.deployment_id,
        "data": e.data,
    }


def job_failure_phase(job: Any) -> str | None:
    """'before execution', 'during execution', 'unknown' for a failed job; None when it did not fail."""
    if job.state != "FAILED":
        return None
    if job.failed_during_execution is True:
        return "during execution"
    if job.failed_during_execution is False:
        return "before execution"
    return "unknown"


def _job(j: Any, *, node_id: NodeId) -> dict[str, Any]:
    placement = j.placement or {}
    return {
        "id": str(j.id),
        "state": j.state,
        "model": j.model.name,
        "kind": j.kind,
        "deployment_id": j.deployment_id,
        "primary": str(placement.get("primary") or "") == node_id,
        "failed": j.state == "FAILED",
        "failure_phase": job_failure_phase(j),
        "failed_during_execution": j.failed_during_execution,
        "error": j.error,
        "finish_reason": j.finish_reason,
        "prompt_tokens": j.prompt_tokens,
        "completion_tokens": j.completion_tokens,
        "ttft_ms": j.ttft_ms,
        "tokens_per_s": j.tokens_per_s,
        "queued_at": j.queued_at,
        "dispatched_at": j.dispatched_at,
        "first_token_at": j.first_token_at,
        "finished_at": j.finished_at,
        "request_id": j.request_id,
    }


def _telemetry(node_id: NodeId) -> dict[str, Any]:
    raw = get_redis().hget(heartbeat_key(node_id), "telemetry")
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def _reachability(node: Node, *, now: datetime) -> dict[str, Any]:
    """Heartbeat age, the node's command queue and a TCP probe of its RPC port, from here."""
    r = get_redis()
    nid = str(node.id)
    with r.pipeline(transaction=False) as pipe:
        pipe.zscore(HEARTBEATS_ZSET, nid)
        pipe.llen(node_queue_key(nid))
        pipe.llen(node_processing_key(nid))
        score, queued, processing = pipe.execute()
    interval = float(settings.HEARTBEAT_INTERVAL)
    age = None if score is None else round(max(0.0, now.timestamp() - float(score)), 3)
    return {
        "heartbeat_age_seconds": age,
        "heartbeat_interval_seconds": interval,
        "heartbeat_late": age is None or age > interval * float(settings.HEARTBEAT_DEGRADED_AFTER),
        "redis_queue_depth": int(queued),
        "redis_processing": int(processing),
        "rpc_probe": rpc_probe(host=node.address, port=node.rpc_port, timeout=RPC_PROBE_TIMEOUT),
    }


def rpc_probe(*, host: str, port: int, timeout: float) -> dict[str, Any]:
    """TCP connect to the node's ggml-rpc port: whether the controller's host can reach it at all."""
    target = f"{host}:{port}"
    if not host:
        return {"target": target, "ok": False, "error": "the node advertised no address"}
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        return {
            "target": target,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "ms": round((time.perf_counter() - t0) * 1000, 1),
        }
    return {"target": target, "ok": True, "ms": round((time.perf_counter() - t0) * 1000, 1)}


def _django_version() -> str:
    return django.get_version()


def _db_vendor() -> str:
    return connection.vendor


# --- summary and packing -------------------------------------------------------------------------


def _summary(files: dict[str, Any]) -> str:
    v, n, r = files["versions.json"], files["node.json"], files["reachability.json"]
    jobs = files["jobs.json"]
    failed = [j for j in jobs if j["failed"]]
    before = sum(1 for j in failed if j["failure_phase"] == "before execution")
    during = sum(1 for j in failed if j["failure_phase"] == "during execution")
    probe = r["rpc_probe"]
    age = r["heartbeat_age_seconds"]
    lines = [
        f"RACoN node diagnostics: {n['name']} ({n['id']})",
        (
            f"controller {v['controller_version']}, agent {v['agent_version'] or 'unknown'}, "
            f"protocol {v['protocol_version']}"
        ),
        f"state: {n['state']} since {_iso(n['state_changed_at'])}"
        + (" (drain requested)" if n["drain_requested"] else "")
        + (f" (revoked {_iso(n['revoked_at'])})" if n["revoked_at"] else ""),
        f"heartbeat: {'never seen since Redis started' if age is None else f'{age:.1f}s ago'}"
        + (" (late)" if r["heartbeat_late"] else ""),
        f"redis queue: {r['redis_queue_depth']} waiting, {r['redis_processing']} in processing",
        f"rpc port {probe['target']}: {'reachable' if probe['ok'] else 'UNREACHABLE (' + probe.get('error', '') + ')'}",
        f"recent jobs: {len(jobs)}, failed {len(failed)} (before execution {before}, during execution {during},"
        f" unknown {len(failed) - before - during})",
    ]
    errors = files["errors.json"]["events"][:5]
    if errors:
        lines.append("last errors:")
        lines += [f"  {_iso(e['at'])} {e['kind']}: {e['message']}" for e in errors]
    history = files["state_history.json"][-5:]
    if history:
        lines.append("last state changes:")
        lines += [
            f"  {_iso(h['at'])} {h['from'] or '-'} -> {h['to']} ({h['kind']})" for h in history
        ]
    return scrub_text("\n".join(lines) + "\n", _secret_values())


def _iso(value: Any) -> str:
    return value.isoformat(timespec="seconds") if isinstance(value, datetime) else str(value or "-")


def _pack(files: dict[str, Any], *, now: datetime) -> bytes:
    secrets = _secret_values()
    buf = io.BytesIO()
    root = f"racon-diagnostics-{now.strftime('%Y%m%dT%H%M%SZ')}"
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, content in files.items():
            if isinstance(content, str):
                raw = scrub_text(content, secrets).encode()
            else:
                raw = (
                    json.dumps(scrub(content, secrets), indent=2, default=str, sort_keys=True)
                    + "\n"
                ).encode()
                raw = scrub_text(
                    raw.decode(), secrets
                ).encode()  # values that only appear once serialised
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(raw)
            info.mtime = int(now.timestamp())
            info.mode = 0o600
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


# --- secrets -------------------------------------------------------------------------------------


def _secret_values() -> list[str]:
    values = [str(getattr(settings, name) or "") for name in SECRET_SETTINGS]
    # Short values would redact ordinary words; real secrets are long.
    return sorted({v for v in values if len(v) >= 8}, key=len, reverse=True)


def is_secret_name(name: Any) -> bool:
    """Whether a field of this name holds a secret (token, secret, credential, key, password)."""
    return isinstance(name, str) and bool(SECRET_NAME.search(name)) and not COUNT_NAME.search(name)


def scrub(value: Any, secrets: list[str]) -> Any:
    """A copy of ``value`` with secret-named fields and known secret values replaced."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if is_secret_name(k) and v not in (None, "", [], {}):
                out[k] = REDACTED
            else:
                out[k] = scrub(v, secrets)
        return out
    if isinstance(value, list | tuple):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, str):
        return scrub_text(value, secrets)
    return value


def scrub_text(text: str, secrets: list[str]) -> str:
    """``text`` with known secret values, issued plaintexts and URL passwords replaced."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    text = SECRET_TEXT.sub(REDACTED, text)
    return URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
