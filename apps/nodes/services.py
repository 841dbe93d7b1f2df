"""Writes for the node registry: enrollment, transitions, heartbeats, the health sweep, drain."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction

from agent.protocol import HEARTBEATS_ZSET, heartbeat_key, is_private_address
from racon.broadcast import broadcast
from racon.celery import task_send
from racon.redis import get_async_redis, get_redis
from racon.redis_acl import node_acl_revoke
from racon.transitions import transition_guarded

from . import hooks
from .events import event_record
from .models import EnrollmentToken, EventCategory, Node
from .states import (
    DEPLOYMENT_SIGNALS,
    DRAIN_STATES,
    DRAINABLE,
    HEALTH_VERDICTS,
    HEALTH_WATCHED,
    ONLINE,
    TRANSITIONS,
    NodeState,
    health_state,
)

log = logging.getLogger("racon.nodes")
S = NodeState


class EnrollmentError(Exception):
    """The enrollment token was refused; the message says why."""


class EnrollmentConflict(EnrollmentError):
    """The enrollment clashes with a node already enrolled (409); ``code`` says which way."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class NodeAuthError(Exception):
    """A node credential was refused; the message says why."""


# --- secrets -----------------------------------------------------------------------------------


def _enrollment_secret() -> bytes:
    secret = settings.NODE_ENROLLMENT_SECRET
    if not secret:
        raise EnrollmentError("enrollment is disabled: NODE_ENROLLMENT_SECRET is not set")
    return secret.encode()


def enrollment_token_hash(token: str) -> str:
    # Keyed by the secret: rotating NODE_ENROLLMENT_SECRET invalidates every outstanding token.
    return hmac.new(_enrollment_secret(), token.encode(), hashlib.sha256).hexdigest()


def credential_hash(credential: str) -> str:
    # Credentials are 256-bit random values, so a fast hash is enough (no password stretching).
    return hashlib.sha256(credential.encode()).hexdigest()


def _meta_key(node_id: Any) -> str:
    return f"racon:node:{node_id}:meta"


def _cache_node(node: Node) -> None:
    """Mirror what a heartbeat needs (credential hash, state, drain request) into Redis."""
    get_redis().hset(
        _meta_key(node.id),
        mapping={
            "cred": "" if node.revoked_at else node.credential_hash,
            "state": node.state,
            "drain": int(node.drain_requested),
        },
    )


# --- enrollment tokens -----------------------------------------------------------------------


def enrollment_token_issue(
    *,
    account_id: Any,
    label: str,
    now: datetime,
    ttl_hours: int | None = None,
    max_uses: int = 1,
    created_by_id: Any = None,
) -> tuple[EnrollmentToken, str]:
    """Create a token; returns it with the plaintext, which is never stored or shown again."""
    if max_uses < 1:
        raise ValueError("max_uses must be at least 1")
    ttl = settings.ENROLLMENT_TOKEN_TTL_HOURS if ttl_hours is None else ttl_hours
    if ttl <= 0:
        raise ValueError("ttl_hours must be positive")
    plaintext = "rcn_" + secrets.token_urlsafe(32)
    token = EnrollmentToken.objects.create(
        label=label,
        token_hash=enrollment_token_hash(plaintext),
        prefix=plaintext[:10],
        account_id=account_id,
        created_by_id=created_by_id,
        expires_at=now + timedelta(hours=ttl),
        max_uses=max_uses,
    )
    return token, plaintext


def enrollment_token_revoke(*, token_id: Any, now: datetime) -> EnrollmentToken:
    """Revoke a token (idempotent)."""
    token = EnrollmentToken.objects.get(pk=token_id)
    if token.revoked_at is None:
        EnrollmentToken.objects.filter(pk=token_id, revoked_at__isnull=True).update(revoked_at=now)
        token.refresh_from_db()
    return token


# --- transitions ------------------------------------------------------------------------------


def node_transition(
    *,
    node_id: Any,
    to: str,
    now: datetime,
    expected: str | Collection[str] | None = None,
    kind: str = "NODE_STATE_CHANGED",
    category: str = EventCategory.LIFECYCLE,
    message: str = "",
    data: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> bool:
    """Move a node to ``to`` if the table allows it and its state is still ``expected``.

    A guarded update (racon.transitions): a stale or duplicate message finds the state already
    changed and is a no-op. Writes the event in the same transaction and broadcasts after commit.
    ``expected`` may be a named group (states.py). Returns whether it moved.
    """

    def record(src: str) -> None:
        event_record(
            kind=kind,
            category=category,
            now=now,
            node_id=node_id,
            old_state=src,
            new_state=to,
            message=message or f"{src} → {to}",
            data=data,
        )

    moved = transition_guarded(
        model=Node,
        pk=node_id,
        to=to,
        table=TRANSITIONS,
        expected=expected,
        fields={"state_changed_at": now, **(extra or {})},
        record=record,
        after_commit=lambda src: _after_transition(node_id, src, to),
        must_exist=True,
        log=log,
    )
    if moved is None:
        return False
    # Mirror now as well as after commit: a heartbeat must see the new state at once. If an outer
    # transaction rolls back, the heartbeat's guarded update fails and re-reads the database.
    _refresh_cache(node_id)
    return True


def _refresh_cache(node_id: Any) -> None:
    node = Node.objects.filter(pk=node_id).first()
    if node is not None:
        _cache_node(node)


def _after_transition(node_id: Any, src: str, to: str) -> None:
    broadcast("nodes.dashboard", {"type": "node.changed", "node_id": str(node_id), "state": to})
    hooks.node_state_moved.send(sender=Node, node_id=str(node_id), old=src, new=to)
    if to in DEPLOYMENT_SIGNALS:
        task_send(
            "racon.jobs.node_state_changed", node_id=str(node_id), state=to
        )  # jobs' task, by name


# --- enrollment -------------------------------------------------------------------------------


_HW_NUMBER_FIELDS = ("ram_total", "ram_available", "vram_total", "vram_free", "disk_free")


def hardware_summary(hardware: dict[str, Any]) -> dict[str, Any]:
    """The denormalised columns the scheduler and dashboard aggregate."""
    cpu = hardware.get("cpu") or {}
    mem = hardware.get("memory") or {}
    gpus = hardware.get("gpus") or []
    bench = hardware.get("benchmark") or {}
    return {
        "cpu_model": str(cpu.get("model", ""))[:200],
        "cpu_physical_cores": int(cpu.get("physical_cores") or 0),
        "cpu_logical_cores": int(cpu.get("logical_cores") or 0),
        "ram_total": int(mem.get("total") or 0),
        "ram_available": int(mem.get("available") or 0),
        "vram_total": sum(int(g.get("vram_total") or 0) for g in gpus),
        "vram_free": sum(int(g.get("vram_free") or 0) for g in gpus),
        "gpu_count": len(gpus),
        "disk_free": int((hardware.get("disk") or {}).get("free") or 0),
        "gflops": float(bench.get("gflops") or 0.0),
        "mem_bandwidth_gbps": float(bench.get("mem_bandwidth_gbps") or 0.0),
    }


def _bound(value: Any, bound: float, *, field: str, unit: str, setting: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"{field} must be a finite number"
    if value < 0:
        return f"{field} must not be negative"
    if value > bound:
        return f"{field} {value} is over the plausible bound {bound:g} {unit} ({setting})"
    return None


def hardware_bounds_errors(hardware: dict[str, Any]) -> dict[str, list[str]]:
    """Field → what is implausible in an agent's inventory (empty when all is within bounds).

    The bounds are settings (NODE_MAX_*): a node's figures are claims, and memory, cores, VRAM and
    benchmark results feed placement and standby pay.
    """
    mem_max, vram_max = settings.NODE_MAX_MEMORY_BYTES, settings.NODE_MAX_VRAM_BYTES
    gflops_max, bw_max = settings.NODE_MAX_GFLOPS, settings.NODE_MAX_BANDWIDTH_GBPS
    errors: dict[str, list[str]] = {}

    def check(group: str, value: Any, bound: float, field: str, unit: str, setting: str) -> None:
        if (msg := _bound(value, bound, field=field, unit=unit, setting=setting)) is not None:
            errors.setdefault(group, []).append(msg)

    cpu = hardware.get("cpu") or {}
    for key in ("physical_cores", "logical_cores"):
        if key in cpu:
            check("cpu", cpu[key], settings.NODE_MAX_CORES, f"cpu.{key}", "cores", "NODE_MAX_CORES")
    mem = hardware.get("memory") or {}
    for key, value in mem.items():
        check("memory", value, mem_max, f"memory.{key}", "bytes", "NODE_MAX_MEMORY_BYTES")
    if (
        isinstance(mem.get("available"), int)
        and isinstance(mem.get("total"), int)
        and mem["available"] > mem["total"]
    ):
        errors.setdefault("memory", []).append(
            f"memory.available {mem['available']} is more than memory.total {mem['total']}"
        )
    for key, value in (hardware.get("swap") or {}).items():
        check("swap", value, mem_max, f"swap.{key}", "bytes", "NODE_MAX_MEMORY_BYTES")
    disk = hardware.get("disk") or {}
    for key in ("total", "free"):
        if key in disk:
            check(
                "disk",
                disk[key],
                settings.NODE_MAX_DISK_BYTES,
                f"disk.{key}",
                "bytes",
                "NODE_MAX_DISK_BYTES",
            )
    for i, gpu in enumerate(hardware.get("gpus") or []):
        for key in ("vram_total", "vram_free"):
            check(
                "gpus",
                gpu.get(key, 0),
                vram_max,
                f"gpus[{i}].{key}",
                "bytes per GPU",
                "NODE_MAX_VRAM_BYTES",
            )
        if int(gpu.get("vram_free") or 0) > int(gpu.get("vram_total") or 0):
            errors.setdefault("gpus", []).append(
                f"gpus[{i}].vram_free is more than gpus[{i}].vram_total"
            )
        for key, bound, unit, setting in (
            ("gflops", gflops_max * 100, "GFLOPS", "100 × NODE_MAX_GFLOPS"),
            ("mem_bandwidth_gbps", bw_max * 5, "GB/s", "5 × NODE_MAX_BANDWIDTH_GBPS"),
        ):
            if key in gpu:
                check("gpus", gpu[key], bound, f"gpus[{i}].{key}", unit, setting)
    bench = hardware.get("benchmark") or {}
    if "gflops" in bench:
        check(
            "benchmark",
            bench["gflops"],
            gflops_max,
            "benchmark.gflops",
            "GFLOPS",
            "NODE_MAX_GFLOPS",
        )
    if "mem_bandwidth_gbps" in bench:
        check(
            "benchmark",
            bench["mem_bandwidth_gbps"],
            bw_max,
            "benchmark.mem_bandwidth_gbps",
            "GB/s",
            "NODE_MAX_BANDWIDTH_GBPS",
        )
    return errors


def _num(value: Any, field: str, *, integer: bool = False) -> float:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"telemetry.{field} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"telemetry.{field} must be a finite, non-negative number")
    return int(value) if integer else float(value)


def telemetry_clean(telemetry: Any) -> dict[str, Any]:
    """The heartbeat's telemetry with the fields the controller reads type-checked (ValueError names
    the field) and bounded: memory over NODE_MAX_MEMORY_BYTES and VRAM over NODE_MAX_VRAM_BYTES
    are clamped, and ``clamped`` lists what was. Pure."""
    if not isinstance(telemetry, dict):
        raise ValueError("telemetry must be an object")
    out = dict(telemetry)
    clamped: list[str] = []
    if "cpu_percent" in telemetry:
        out["cpu_percent"] = min(
            _num(telemetry.get("cpu_percent"), "cpu_percent"), 100.0 * settings.NODE_MAX_CORES
        )
    if "mem_available" in telemetry:
        mem = int(_num(telemetry.get("mem_available"), "mem_available", integer=True))
        if mem > settings.NODE_MAX_MEMORY_BYTES:
            mem = settings.NODE_MAX_MEMORY_BYTES
            clamped.append("mem_available")
        out["mem_available"] = mem
    gpu_free = telemetry.get("gpu_free") or []
    if not isinstance(gpu_free, list) or len(gpu_free) > 16:
        raise ValueError("telemetry.gpu_free must be a list of at most 16 numbers")
    frees = []
    for i, x in enumerate(gpu_free):
        v = int(_num(x, f"gpu_free[{i}]", integer=True))
        if v > settings.NODE_MAX_VRAM_BYTES:
            v = settings.NODE_MAX_VRAM_BYTES
            clamped.append(f"gpu_free[{i}]")
        frees.append(v)
    if "gpu_free" in telemetry:
        out["gpu_free"] = frees
    jobs = telemetry.get("jobs") or []
    if not isinstance(jobs, list):
        raise ValueError("telemetry.jobs must be a list")
    rpc = telemetry.get("rpc_worker") or {}
    if not isinstance(rpc, dict):
        raise ValueError("telemetry.rpc_worker must be an object")
    if clamped:
        out["clamped"] = clamped
    return out


@dataclass(frozen=True)
class Enrollment:
    node: Node
    credential: str
    created: bool


def node_enroll(
    *,
    token: str,
    node_name: str,
    machine_id: str,
    hardware: dict[str, Any],
    address: str,
    rpc_port: int,
    agent_version: str,
    now: datetime,
    models: list[dict[str, Any]] | None = None,
    presented: tuple[str, str] | None = None,
    source_address: str | None = None,
) -> Enrollment:
    """Validate the token and create the node, or give the same machine back its node.

    Issues a fresh credential each time (the previous one stops working). A machine already
    enrolled gets its node back only with that node's current credential (``presented``, from
    ``Authorization: Node <id>:<credential>``) or once after an operator's node_reenroll_allow;
    otherwise EnrollmentConflict, and the node and its credential stay as they were. Node names
    are unique within an account (EnrollmentConflict). Nothing is written when the enrollment is
    refused, except PUBLIC_IP_VIOLATION, which is recorded only when the token is valid.
    """
    digest = enrollment_token_hash(token)
    # The advertised address is a claim; the address the request came from is what we saw.
    public = next((a for a in (address, source_address) if a and not is_private_address(a)), None)
    try:
        with transaction.atomic():
            tok = EnrollmentToken.objects.select_for_update().filter(token_hash=digest).first()
            if tok is None:
                raise EnrollmentError("invalid enrollment token")
            if tok.revoked_at is not None:
                raise EnrollmentError("enrollment token has been revoked")
            if tok.expires_at <= now:
                raise EnrollmentError("enrollment token has expired")
            if public is None:
                enrollment = _enroll_locked(
                    tok=tok,
                    node_name=node_name,
                    machine_id=machine_id,
                    hardware=hardware,
                    address=address,
                    rpc_port=rpc_port,
                    agent_version=agent_version,
                    now=now,
                    models=models,
                    presented=presented,
                )
    except IntegrityError as exc:
        # Two enrollments with other tokens raced for one name or machine: the database kept one.
        raise EnrollmentConflict(
            f"another enrollment of node name {node_name!r} or this machine was stored first; "
            "retry, or choose another --node-name",
            code="enrollment_race",
        ) from exc
    if public is not None:
        # Outside the token's transaction: a refusal raised inside it would roll the event back.
        what = "advertised" if public == address else "connected from"
        event_record(
            kind="PUBLIC_IP_VIOLATION",
            category=EventCategory.SECURITY,
            now=now,
            message=f"Public IP security violation: enrollment of {node_name!r} {what} {public}",
            data={
                "address": address,
                "source_address": source_address or "",
                "node_name": node_name,
                "token_prefix": tok.prefix,
            },
        )
        raise EnrollmentError(
            "Public IP security violation: "
            f"{'advertise address' if public == address else 'the enrollment came from'} "
            f"{public}, which is not private"
        )
    enrollment.node.refresh_from_db()
    _cache_node(enrollment.node)
    return enrollment


def _enroll_locked(
    *,
    tok: EnrollmentToken,
    node_name: str,
    machine_id: str,
    hardware: dict[str, Any],
    address: str,
    rpc_port: int,
    agent_version: str,
    now: datetime,
    models: list[dict[str, Any]] | None,
    presented: tuple[str, str] | None,
) -> Enrollment:
    """node_enroll's writes, under the token's row lock (its caller's transaction)."""
    existing = Node.objects.select_for_update().filter(machine_id=machine_id).first()
    if existing is None and tok.uses >= tok.max_uses:
        raise EnrollmentError("enrollment token has been used up")
    if existing is not None:
        if existing.revoked_at is not None:
            raise EnrollmentError("this node has been revoked by an administrator")
        _reenroll_check(existing=existing, presented=presented)
    account_id = existing.account_id if existing is not None else tok.account_id
    clash = Node.objects.filter(account_id=account_id, name=node_name, revoked_at__isnull=True)
    if existing is not None:
        clash = clash.exclude(pk=existing.pk)
    other = clash.values_list("id", flat=True).first()
    if other is not None:
        raise EnrollmentConflict(
            f"node name {node_name!r} is already used by node {other} in this account; choose another --node-name",
            code="node_name_taken",
        )
    same_endpoint = Node.objects.filter(address=address, rpc_port=rpc_port, revoked_at__isnull=True)
    if existing is not None:
        same_endpoint = same_endpoint.exclude(pk=existing.pk)
    holder = same_endpoint.values_list("name", flat=True).first()
    if holder is not None:
        raise EnrollmentConflict(
            f"advertise address {address}:{rpc_port} is already used by node {holder!r}; "
            "each node needs its own address and --rpc-port",
            code="address_taken",
        )
    credential = "rnc_" + secrets.token_urlsafe(32)
    summary = hardware_summary(hardware)
    speed = _speed_fields(existing=existing, claimed=summary["gflops"])
    fields = {
        "name": node_name,
        "hardware": hardware,
        "address": address,
        "rpc_port": rpc_port,
        "agent_version": agent_version,
        "credential_hash": credential_hash(credential),
        "revoked_at": None,
        **summary,
        **speed,
    }
    if existing is not None:
        # The operator's permission, if that is what let it through, is used up now.
        get_redis().delete(_reenroll_key(existing.pk))
        Node.objects.filter(pk=existing.pk).update(**fields)
        node = Node.objects.get(pk=existing.pk)
        created = False
    else:
        node = Node.objects.create(
            machine_id=machine_id,
            account_id=tok.account_id,
            enrollment_token=tok,
            state=S.UNINITIALIZED,
            state_changed_at=now,
            **fields,
        )
        EnrollmentToken.objects.filter(pk=tok.pk).update(uses=tok.uses + 1)
        created = True
    event_record(
        kind="NODE_ENROLLED",
        category=EventCategory.LIFECYCLE,
        now=now,
        node_id=node.id,
        message=f"{node_name} enrolled" if created else f"{node_name} enrolled again",
        data={"created": created, "address": address, "agent_version": agent_version, **summary},
    )
    # The handshake: any prior state (OFFLINE, ERROR, READY of a previous run) → REGISTERING.
    if node.state != S.REGISTERING:
        node_transition(node_id=node.id, to=S.REGISTERING, now=now, message="agent handshake")
    if models is not None:
        hooks.node_models_reported.send(sender=Node, node_id=node.id, files=models, now=now)
    return Enrollment(node=node, credential=credential, created=created)


def _speed_fields(*, existing: Node | None, claimed: float) -> dict[str, Any]:
    """gflops as the scheduler may use it: a claim is taken as it stands only when SPEED_CHALLENGE
    is off, when it is at most SPEED_UNVERIFIED_GFLOPS, or when a challenge already confirmed this
    very figure; otherwise the node is credited SPEED_UNVERIFIED_GFLOPS until it is challenged."""
    floor = float(settings.SPEED_UNVERIFIED_GFLOPS)
    if not settings.SPEED_CHALLENGE or claimed <= floor:
        return {"gflops": claimed, "gflops_claimed": claimed, "speed_verified_at": None}
    if (
        existing is not None
        and existing.speed_verified_at is not None
        and existing.gflops_claimed == claimed
    ):
        return {
            "gflops": existing.gflops,
            "gflops_claimed": claimed,
            "speed_verified_at": existing.speed_verified_at,
        }
    return {"gflops": floor, "gflops_claimed": claimed, "speed_verified_at": None}


def _reenroll_key(node_id: Any) -> str:
    return f"racon:reenroll:{node_id}"


def _reenroll_check(*, existing: Node, presented: tuple[str, str] | None) -> None:
    """Refuse taking over an enrolled machine without its node's current credential or an
    operator's permission (EnrollmentConflict)."""
    if (
        presented is not None
        and presented[0] == str(existing.pk)
        and hmac.compare_digest(existing.credential_hash, credential_hash(presented[1]))
    ):
        return
    if get_redis().exists(_reenroll_key(existing.pk)):
        return
    why = (
        "the credential presented is not its current one"
        if presented is not None
        else "no node credential was presented"
    )
    raise EnrollmentConflict(
        f"machine {existing.machine_id!r} is already enrolled as node {existing.name!r} ({existing.pk}) and {why}: "
        "re-enrolling it needs that node's current credential (Authorization: Node <id>:<credential>) "
        "or an operator's allow-reenroll (POST /api/admin/nodes/<id>/allow-reenroll)",
        code="machine_enrolled",
    )


def node_reenroll_allow(*, node_id: Any, now: datetime, ttl_seconds: int | None = None) -> int:
    """Operator action: let the next enrollment of this node's machine take it over without its
    credential (once, within ttl_seconds). Returns the window in seconds."""
    ttl = int(ttl_seconds or settings.NODE_REENROLL_WINDOW_SECONDS)
    node = Node.objects.get(pk=node_id)
    get_redis().set(_reenroll_key(node.pk), 1, ex=ttl)
    event_record(
        kind="NODE_REENROLL_ALLOWED",
        category=EventCategory.SECURITY,
        now=now,
        node_id=node.pk,
        message=f"an operator allowed {node.name} to be enrolled again without its credential, for {ttl}s",
        data={"ttl_seconds": ttl},
    )
    return ttl


def node_id_valid(node_id: Any) -> bool:
    """Whether ``node_id`` is a UUID (a malformed one is refused before any lookup). Pure."""
    try:
        uuid.UUID(str(node_id))
    except ValueError:
        return False
    return True


def node_authenticate(*, node_id: str, credential: str) -> Node:
    """Check a node credential against the database (slow path; heartbeats use Redis)."""
    if not node_id_valid(node_id):
        raise NodeAuthError("malformed node id: expected a UUID")
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise NodeAuthError("unknown node")
    if node.revoked_at is not None:
        raise NodeAuthError("node has been revoked")
    if not hmac.compare_digest(node.credential_hash, credential_hash(credential)):
        raise NodeAuthError("invalid node credential")
    return node


def node_revoke(*, node_id: Any, now: datetime) -> None:
    """Revoke a node's credential: its heartbeats and reports get 401 from now on."""
    with transaction.atomic():
        Node.objects.filter(pk=node_id).update(revoked_at=now)
        event_record(
            kind="NODE_REVOKED",
            category=EventCategory.SECURITY,
            now=now,
            node_id=node_id,
            message="node revoked",
        )
        node_transition(node_id=node_id, to=S.OFFLINE, now=now, message="revoked")
    get_redis().delete(_meta_key(node_id))
    if settings.NODE_REDIS_ACL:
        node_acl_revoke(node_id=node_id)  # and Redis drops the node's open connections


# --- heartbeats --------------------------------------------------------------------------------


def heartbeat_target(
    *, current: str, wanted: str | None, busy: bool, drain_requested: bool
) -> str | None:
    """The state a heartbeat should move the node to, or None to stay. Pure."""
    if wanted == S.ERROR:
        return S.ERROR if current != S.ERROR else None
    if current in (S.UNINITIALIZED, S.ERROR):
        return None  # only a handshake leaves these
    if current == S.REGISTERING and wanted not in ONLINE:
        return None  # the agent's runtime checks have not passed yet
    if wanted in (S.UNINITIALIZED, S.REGISTERING):
        return None
    if drain_requested:
        return None if current in DRAIN_STATES else S.DRAINING
    target = S.BUSY if busy else S.READY
    return target if target != current else None


# One round trip per heartbeat: check the credential hash against the mirror, record the time and
# telemetry, and return the mirrored state. Returns {} when the mirror is missing (rebuild it).
# The hashes compared are SHA-256 of 256-bit random credentials, so a plain comparison leaks nothing useful.
_HEARTBEAT_LUA = """
local meta = redis.call('HGETALL', KEYS[1])
if #meta == 0 then return {} end
local m = {}
for i = 1, #meta, 2 do m[meta[i]] = meta[i + 1] end
if m['cred'] == nil or m['cred'] == '' then return {'revoked'} end
if m['cred'] ~= ARGV[1] then return {'bad'} end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], 'at', ARGV[2], 'cpu_percent', ARGV[4], 'mem_available', ARGV[5], 'gpu_free', ARGV[6],
  'rpc_worker', ARGV[7], 'jobs', ARGV[8], 'telemetry', ARGV[9])
return {'ok', m['state'] or '', m['drain'] or '0'}
"""


_scripts: dict[int, Any] = {}


def _heartbeat_script(r: Any) -> Any:
    """The registered script (EVALSHA after the first call), one per client."""
    script = _scripts.get(id(r))
    if script is None:
        script = _scripts[id(r)] = r.register_script(_HEARTBEAT_LUA)
    return script


async def node_heartbeat(
    *, node_id: str, credential: str, payload: dict[str, Any], now: datetime
) -> str:
    """Record a heartbeat in Redis; touch the database only when the state must change.

    The controller's clock decides: the agent's ``sent_at`` is stored as telemetry only.
    """
    r = get_async_redis()
    # Bounded once more here, for callers that skip heartbeat_handle (idempotent).
    telemetry = telemetry_clean(payload.get("telemetry") or {})
    ts = now.timestamp()
    jobs = telemetry.get("jobs") or []
    args = [
        credential_hash(credential),
        ts,
        node_id,
        float(telemetry.get("cpu_percent") or 0.0),
        int(telemetry.get("mem_available") or 0),
        ",".join(str(int(x)) for x in telemetry.get("gpu_free") or []),
        int(bool((telemetry.get("rpc_worker") or {}).get("running"))),
        len(jobs),
        _json_dumps(telemetry),
    ]
    keys = [_meta_key(node_id), HEARTBEATS_ZSET, heartbeat_key(node_id)]
    script = _heartbeat_script(r)
    result = await script(keys=keys, args=args)
    if not result:
        # Redis lost the mirror (restart or flush): rebuild it from the database once, then retry.
        if await sync_to_async(_meta_from_db)(node_id) is None:
            raise NodeAuthError("unknown node")
        result = await script(keys=keys, args=args)
    if not result or result[0] == "revoked":
        raise NodeAuthError("node has been revoked")
    if result[0] != "ok":
        raise NodeAuthError("invalid node credential")
    _, current, drain = result[:3]
    if telemetry.get("clamped"):
        await sync_to_async(_telemetry_clamped)(node_id, telemetry["clamped"], now)
    target = heartbeat_target(
        current=current, wanted=payload.get("state"), busy=bool(jobs), drain_requested=drain == "1"
    )
    if target is not None:
        moved = await sync_to_async(_heartbeat_transition)(node_id, current, target, now, telemetry)
        if moved:
            current = target
    if current == S.DRAINING and not jobs:
        # The drain's backstop: its steps also run when a job ends and when a replacement is READY.
        await sync_to_async(node_drain_advance)(node_id=node_id, now=now)
    return current


def _telemetry_clamped(node_id: str, fields: list[str], now: datetime) -> None:
    # One row an hour per node at most: never one per heartbeat.
    if get_redis().set(f"racon:node:{node_id}:clamped", 1, nx=True, ex=3600):
        event_record(
            kind="TELEMETRY_CLAMPED",
            category=EventCategory.SECURITY,
            now=now,
            node_id=node_id,
            message=f"heartbeat figures over the plausible bounds were clamped: {', '.join(fields)}",
            data={"fields": fields},
        )


def _json_dumps(value: Any) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))[:16384]


def _meta_from_db(node_id: str) -> dict[str, str] | None:
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        return None
    _cache_node(node)
    return get_redis().hgetall(_meta_key(node_id))


def _heartbeat_transition(
    node_id: str, current: str, target: str, now: datetime, telemetry: dict[str, Any]
) -> bool:
    if target == S.ERROR:
        kind, category, message = "NODE_FAULT", EventCategory.HEALTH, "agent reported a fatal fault"
    elif current in HEALTH_VERDICTS:
        kind, category, message = "HEARTBEAT_RESTORED", EventCategory.HEALTH, "heartbeat restored"
    elif current == S.REGISTERING:
        kind, category, message = "NODE_READY", EventCategory.LIFECYCLE, "runtime checks passed"
    else:
        kind, category, message = "NODE_STATE_CHANGED", EventCategory.EXECUTION, ""
    extra: dict[str, Any] = {"last_heartbeat_at": now}
    if "mem_available" in telemetry:
        # Never more free than the node has (ram_total was bounded at enrollment).
        total = Node.objects.filter(pk=node_id).values_list("ram_total", flat=True).first() or 0
        extra["ram_available"] = min(int(telemetry.get("mem_available") or 0), int(total))
    moved = node_transition(
        node_id=node_id,
        to=target,
        expected=current,
        now=now,
        kind=kind,
        category=category,
        message=message,
        extra=extra,
    )
    if not moved:
        _refresh_cache(node_id)  # the mirror was stale
    return moved


def node_report_fault(*, node_id: Any, fatal: bool, message: str, now: datetime) -> None:
    """An agent reported a fault: fatal → ERROR, otherwise DEGRADED (fallback only)."""
    target = S.ERROR if fatal else S.DEGRADED
    node_transition(
        node_id=node_id,
        to=target,
        now=now,
        kind="NODE_FAULT",
        category=EventCategory.HEALTH,
        message=message[:500],
    )


# --- health sweep ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepResult:
    degraded: list[str]
    offline: list[str]
    suppressed: list[str]


def node_health_sweep(*, now: datetime) -> SweepResult:
    """Apply the heartbeat thresholds; guard against marking most of the cluster OFFLINE at once."""
    interval = settings.HEARTBEAT_INTERVAL
    watched = list(
        Node.objects.filter(state__in=HEALTH_WATCHED, revoked_at__isnull=True).values_list(
            "id", "state", "last_heartbeat_at", "state_changed_at"
        )
    )
    if not watched:
        return SweepResult([], [], [])
    ids = [str(n[0]) for n in watched]
    scores = get_redis().zmscore(HEARTBEATS_ZSET, ids)
    to_degrade: list[tuple[str, str, float]] = []
    to_offline: list[tuple[str, str, float]] = []
    live_count = 0
    for (pk, state, last_db, changed_at), score in zip(watched, scores, strict=True):
        if state != S.DEGRADED:
            live_count += 1
        last = (
            score
            if score is not None
            else max(
                (t.timestamp() for t in (last_db, changed_at) if t is not None),
                default=now.timestamp(),
            )
        )
        age = max(0.0, now.timestamp() - last)
        verdict = health_state(
            age=age,
            interval=interval,
            degraded_after=settings.HEARTBEAT_DEGRADED_AFTER,
            offline_after=settings.HEARTBEAT_OFFLINE_AFTER,
        )
        if verdict == S.OFFLINE:
            to_offline.append((str(pk), state, age))
        elif verdict == S.DEGRADED and state != S.DEGRADED:
            to_degrade.append((str(pk), state, age))
    suppressed: list[str] = []
    total = len(watched)
    if (
        len(to_offline) >= settings.MASS_FAILURE_MIN_NODES
        and len(to_offline) >= settings.MASS_FAILURE_FRACTION * total
    ):
        # Most of the cluster went silent in one sweep: far likelier a controller-side network
        # fault than that many machines failing together. Raise one event, keep them DEGRADED.
        suppressed = [n for n, _, _ in to_offline]
        r = get_redis()
        if r.set(
            "racon:cluster:partition", now.timestamp(), nx=True, ex=int(max(60, interval * 12))
        ):
            event_record(
                kind="CLUSTER_PARTITION_SUSPECTED",
                category=EventCategory.HEALTH,
                now=now,
                message=f"{len(suppressed)} of {total} nodes went silent in one sweep; not marking them OFFLINE",
                data={"nodes": suppressed},
            )
        to_degrade.extend((n, st, age) for n, st, age in to_offline if st != S.DEGRADED)
        to_offline = []
    degraded: list[str] = []
    offline: list[str] = []
    for node_id, state, age in to_degrade:
        if node_transition(
            node_id=node_id,
            to=S.DEGRADED,
            expected=state,
            now=now,
            kind="HEARTBEAT_TIMEOUT",
            category=EventCategory.HEALTH,
            message=f"heartbeat late by {age:.1f}s",
            data={"age": round(age, 3)},
        ):
            degraded.append(node_id)
    for node_id, state, age in to_offline:
        if node_transition(
            node_id=node_id,
            to=S.OFFLINE,
            expected=state,
            now=now,
            kind="HEARTBEAT_TIMEOUT",
            category=EventCategory.HEALTH,
            message=f"no heartbeat for {age:.1f}s",
            data={"age": round(age, 3)},
        ):
            offline.append(node_id)
    return SweepResult(degraded, offline, suppressed)


# --- drain -------------------------------------------------------------------------------------
#
# DRAINING (operator) → the apps above move their work off (jobs: a replacement deployment on
# other nodes, the old one stopped once the new one is READY and its own jobs have ended, or at
# the end when no capacity exists) → DRAINED with NODE_DRAINED, once nothing of theirs is left.
# drain_requested outlives an OFFLINE spell: the next heartbeat drains the node again.


def node_drain(*, node_id: Any, now: datetime) -> Node:
    """Stop assigning new work to the node; its work moves or finishes, then it is DRAINED."""
    node = Node.objects.get(pk=node_id)
    with transaction.atomic():
        Node.objects.filter(pk=node_id).update(drain_requested=True)
        # A heartbeat may move BUSY ⇄ READY between our read and the guarded update: re-read and retry.
        for _ in range(3):
            state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
            if state not in DRAINABLE:
                break
            if node_transition(
                node_id=node_id,
                to=S.DRAINING,
                expected=state,
                now=now,
                kind="NODE_DRAIN_REQUESTED",
                category=EventCategory.MANAGEMENT,
                message="drain requested",
            ):
                break
    node.refresh_from_db()
    _cache_node(node)
    node_drain_advance(node_id=node_id, now=now)
    node.refresh_from_db()
    return node


def node_drain_advance(*, node_id: Any, now: datetime) -> bool:
    """One step of a drain: the apps above move or stop their work; DRAINED once none is left.

    Idempotent, and run from several places (the drain request, a job's end, a replacement
    becoming READY, the node's heartbeat); NODE_DRAINED is written by the one guarded
    DRAINING → DRAINED transition, so once. Returns whether the node is DRAINED now.
    """
    if Node.objects.filter(pk=node_id).values_list("state", flat=True).first() != S.DRAINING:
        return False
    if hooks.node_drain_step(node_id=node_id, now=now):
        return False
    return node_transition(
        node_id=node_id,
        to=S.DRAINED,
        expected=S.DRAINING,
        now=now,
        kind="NODE_DRAINED",
        category=EventCategory.MANAGEMENT,
        message="node drained: its deployments moved or stopped, and its last job has ended",
    )


def node_undrain(*, node_id: Any, now: datetime) -> Node:
    """Accept new work again."""
    with transaction.atomic():
        Node.objects.filter(pk=node_id).update(drain_requested=False)
        state = Node.objects.filter(pk=node_id).values_list("state", flat=True).first()
        if state in DRAIN_STATES:
            node_transition(
                node_id=node_id,
                to=S.READY,
                expected=state,
                now=now,
                kind="NODE_UNDRAINED",
                category=EventCategory.MANAGEMENT,
                message="drain lifted",
            )
    node = Node.objects.get(pk=node_id)
    _cache_node(node)
    return node
