"""Writes for enrollment: tokens, a node's enrollment and re-enrollment (bounded, checked
hardware claims), its credential, and revocation.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from agent.protocol import is_private_address
from racon import ids
from racon.ids import AccountId, NodeId
from racon.redis import get_redis
from racon.redis_acl import node_acl_revoke

from . import hooks
from .commands import node_command_key
from .events import event_record
from .gpu_challenges import gpu_challenge_kept
from .models import EnrollmentToken, EventCategory, Node
from .services import _cache_node, _meta_key, _stored_hash, node_transition
from .states import Engine, NodeState

S = NodeState


class EnrollmentError(Exception):
    """The enrollment token was refused; the message says why."""


class EnrollmentConflict(EnrollmentError):
    """The enrollment clashes with a node already enrolled (409); ``code`` says which way."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class NodeAuthError(Exception):
    """A node credential was refused; the message says why, ``code`` says which way
    (``node_revoked``, ``unknown_node``, ``malformed_node_id``, ``missing_credential`` or
    ``invalid_credential``), so no caller, and no agent, tells them apart by their words."""

    def __init__(self, message: str, *, code: str = "invalid_credential") -> None:
        super().__init__(message)
        self.code = code


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


# --- enrollment tokens -----------------------------------------------------------------------


def enrollment_token_issue(
    *,
    account_id: AccountId,
    label: str,
    now: datetime,
    ttl_hours: int | None = None,
    max_uses: int = 1,
    created_by_id: int | None = None,
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


def enrollment_token_revoke(*, token_id: uuid.UUID | str, now: datetime) -> EnrollmentToken:
    """Revoke a token (idempotent)."""
    token = EnrollmentToken.objects.get(pk=token_id)
    if token.revoked_at is None:
        EnrollmentToken.objects.filter(pk=token_id, revoked_at__isnull=True).update(revoked_at=now)
        token.refresh_from_db()
    return token


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


@dataclass(frozen=True)
class Enrollment:
    node: Node
    credential: str
    created: bool

    @property
    def command_key(self) -> str:
        """Hex: the key this node's commands are signed with, sent in the enrollment answer."""
        cred = credential_hash(self.credential)
        return node_command_key(node_id=ids.node_id(self.node.id), credential_hash=cred).hex()


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
                advertise_address_check(address=address, source_address=source_address)
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


def advertise_address_check(*, address: str, source_address: str | None) -> None:
    """A node on another machine advertises the address its enrollment came from: its peers'
    RPC and link probes go there, so any other (a LAN service, a loopback or link-local one that
    means something else on each host) is refused. A node on the controller's own machine
    (a loopback source) may advertise any private address. Raises EnrollmentError."""
    if not source_address:
        return  # not over HTTP (a management command): nothing was seen to compare with
    try:
        src = ipaddress.ip_address(source_address.strip("[]"))
        adv = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        raise EnrollmentError(f"advertise address {address!r} is not an IP address") from None
    src = getattr(src, "ipv4_mapped", None) or src
    adv = getattr(adv, "ipv4_mapped", None) or adv
    if src.is_loopback or adv == src:
        return
    fix = f"start the agent with --advertise-address {src}"
    if adv.is_loopback or adv.is_link_local:
        kind = "loopback" if adv.is_loopback else "link-local"
        raise EnrollmentError(
            f"advertise address {address} is {kind}, which other machines cannot reach; this "
            f"enrollment came from {src}: {fix}"
        )
    raise EnrollmentError(
        f"advertise address {address} is not the address this enrollment came from ({src}); "
        f"peers would be sent to {address}: {fix}"
    )


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
    """node_enroll's writes, under the token's row lock (its caller's transaction).

    machine_id comes from the world-readable /etc/machine-id, so it names a machine within an
    account only (issue 28): the node this machine already is, is the one its current credential
    names (kept in its own account), or else this machine's node in the token's account. Another
    account's node with the same machine_id is someone else's claim: never handed over, not even
    with an operator's allow-reenroll, and no obstacle to enrolling here."""
    existing = _node_presented(machine_id=machine_id, presented=presented) or (
        Node.objects.select_for_update()
        .filter(machine_id=machine_id, account_id=tok.account_id)
        .first()
    )
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
    # What the controller owns in the inventory (GPU challenge record, verified GPU figures).
    hardware = gpu_challenge_kept(old=existing.hardware if existing else None, new=hardware)
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
        get_redis().delete(_reenroll_key(ids.node_id(existing.pk)))
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
        node_id=ids.node_id(node.id),
        message=f"{node_name} enrolled" if created else f"{node_name} enrolled again",
        data={"created": created, "address": address, "agent_version": agent_version, **summary},
    )
    # The handshake: any prior state (OFFLINE, ERROR, READY of a previous run) → REGISTERING.
    if node.state != S.REGISTERING:
        node_transition(
            node_id=ids.node_id(node.id), to=S.REGISTERING, now=now, message="agent handshake"
        )
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


def _node_presented(*, machine_id: str, presented: tuple[str, str] | None) -> Node | None:
    """The node of this machine whose current credential was presented, locked; else None."""
    if presented is None or not node_id_valid(presented[0]):
        return None
    node = Node.objects.select_for_update().filter(pk=presented[0], machine_id=machine_id).first()
    if node is None or not hmac.compare_digest(node.credential_hash, credential_hash(presented[1])):
        return None
    return node


def _reenroll_key(node_id: NodeId) -> str:
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
    if get_redis().exists(_reenroll_key(ids.node_id(existing.pk))):
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


def node_reenroll_allow(*, node_id: NodeId, now: datetime, ttl_seconds: int | None = None) -> int:
    """Operator action: let the next enrollment of this node's machine take it over without its
    credential (once, within ttl_seconds). Returns the window in seconds."""
    ttl = int(ttl_seconds or settings.NODE_REENROLL_WINDOW_SECONDS)
    node = Node.objects.get(pk=node_id)
    get_redis().set(_reenroll_key(ids.node_id(node.pk)), 1, ex=ttl)
    event_record(
        kind="NODE_REENROLL_ALLOWED",
        category=EventCategory.SECURITY,
        now=now,
        node_id=ids.node_id(node.pk),
        message=f"an operator allowed {node.name} to be enrolled again without its credential, for {ttl}s",
        data={"ttl_seconds": ttl},
    )
    return ttl


def node_id_valid(node_id: object) -> bool:
    """Whether ``node_id`` is a UUID (a malformed one is refused before any lookup). Pure."""
    try:
        uuid.UUID(str(node_id))
    except ValueError:
        return False
    return True


def _node_id_checked(node_id: str) -> NodeId:
    """The id an agent sent, parsed once; a malformed one is refused before any lookup."""
    try:
        return ids.node_id(node_id)
    except ValueError:
        raise NodeAuthError(
            "malformed node id: expected a UUID", code="malformed_node_id"
        ) from None


def _credential_check(stored: str, credential: str) -> None:
    if not stored:
        raise NodeAuthError("node has been revoked", code="node_revoked")
    if not hmac.compare_digest(stored, credential_hash(credential)):
        raise NodeAuthError("invalid node credential")


def node_authenticate(*, node_id: str, credential: str) -> Node:
    """Check a node credential (the id and credential the agent sent, as text) against the
    database (slow path; heartbeats use Redis)."""
    node = Node.objects.filter(pk=_node_id_checked(node_id)).first()
    if node is None:
        raise NodeAuthError("unknown node", code="unknown_node")
    _credential_check(_stored_hash(node), credential)
    return node


def node_authenticate_id(*, node_id: str, credential: str) -> NodeId:
    """node_authenticate for a caller that needs only the node's id (the agent's reports, one
    per job): checked against the heartbeat mirror in Redis (the credential's hash, "" once
    revoked; node_revoke drops it), so no Node row is read. A cold mirror is rebuilt from the
    database first (same errors as node_authenticate)."""
    nid = _node_id_checked(node_id)
    cached = get_redis().hget(_meta_key(nid), "cred")
    if cached is None:
        node = Node.objects.filter(pk=nid).first()
        if node is None:
            raise NodeAuthError("unknown node", code="unknown_node")
        _cache_node(node)
        cached = _stored_hash(node)
    _credential_check(str(cached), credential)
    return nid


def node_revoke(*, node_id: NodeId, now: datetime) -> None:
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


def node_engines_update(*, node_id: NodeId, engines: Any, now: datetime) -> list[str]:
    """A resumed agent's engines (HARDWARE_UPDATED at its start): RACON_ENGINES may have changed
    since enrollment, as when `make run` is started again with vllm. A claim like the enrolled one
    (only "where vLLM could go"; a node without the engine fails its load, with the log): known
    names only, else ValueError naming the field. Returns the engines now stored."""
    known = {str(e) for e in Engine.values}
    if not isinstance(engines, list) or not engines or len(engines) > len(known):
        raise ValueError(f"hardware.engines must be a list of 1 to {len(known)} engine names")
    bad = [e for e in engines if not isinstance(e, str) or e not in known]
    if bad:
        raise ValueError(
            f"hardware.engines names an unknown engine {bad[0]!r} (known: {sorted(known)})"
        )
    wanted = sorted(set(engines))
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is None:
            raise ValueError("unknown node")
        hardware = dict(node.hardware or {})
        if sorted(hardware.get("engines") or ["llamacpp"]) == wanted:
            return wanted
        before = hardware.get("engines") or ["llamacpp"]
        hardware["engines"] = wanted
        Node.objects.filter(pk=node_id).update(hardware=hardware)
        event_record(
            kind="NODE_ENGINES_CHANGED",
            category=EventCategory.MANAGEMENT,
            now=now,
            node_id=node_id,
            message=f"engines {', '.join(before)} → {', '.join(wanted)}",
            data={"before": before, "engines": wanted},
        )
    return wanted
