"""KV state transfer: a draining replica's conversations move to another replica instead of being
dropped (docs/design/serving.md, "KV cache coordinator", issue 16).

For each conversation a slot of the old replica holds (kvcache.slots_held), one transfer:

1. the controller records the transfer (``racon:kv:xfer:{id}``: which node may upload, which may
   download) and sends the old primary ``kv_save``;
2. the agent saves the slot (llama-server ``POST /slots/{id}?action=save``) and uploads the file to
   ``/api/agent/kv/{id}`` with its node credential; the controller accepts it only from the old
   primary, at most ``KV_TRANSFER_MAX_BYTES``, and hashes what it received (the agent's own sha256
   in its command result is a claim, compared against it);
3. the controller reserves a free slot on the new owner (kvcache.slot_reserve) and sends its
   primary ``kv_restore`` with the URL, size and the controller's sha256, but only once the file
   parses as llama.cpp's saved slot and its header matches the model, the bytes per token and
   the token count of the controller's ownership record (kvstate.py; a node's upload is a claim,
   never forwarded into another contributor's llama-server unchecked); that node alone may
   download it, checks the sha256, restores the slot (``action=restore``) and reports the tokens
   restored;
4. ownership moves to that slot (kvcache.conversation_moved: KV_STATE_MOVED with bytes and
   seconds, counted in /metrics).

Any failure drops that conversation with KV_STATE_DROPPED naming why (never silently): its next
turn prefills on its new replica. The blob is deleted when its transfer ends either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from django.conf import settings

from agent.protocol import new_id
from apps.models_repo.profile import ModelProfile
from apps.nodes.commands import command_send, command_wait
from racon import ids
from racon.ids import DeploymentId, NodeId
from racon.redis import get_redis

from . import kvcache, selectors
from .jobs import drains_advance
from .kvstate import KvStateInvalid, kv_state_check, kv_state_read
from .models import Deployment, Job
from .states import DEPLOYMENT_PENDING, JOB_OPEN

log = logging.getLogger("racon.jobs.kvtransfer")

XFER_TTL_SECONDS = 900
_CHUNK = 1 << 20


def xfer_key(transfer_id: str) -> str:
    """HASH: from_node, to_node, from_dep, state (awaiting_upload → uploaded), size, sha256, path."""
    return f"racon:kv:xfer:{transfer_id}"


def blob_dir() -> Path:
    return Path(settings.VAR_DIR) / "kv-transfers"


class TransferRefused(Exception):
    """An upload or download a node may not make; ``status`` is the HTTP answer."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


# --- the agent endpoints' side ---------------------------------------------------------------------


def _record(transfer_id: str) -> dict[str, str]:
    if not transfer_id.isalnum() or len(transfer_id) > 64:
        raise TransferRefused(f"transfer_id {transfer_id!r} is malformed", status=400)
    rec = get_redis().hgetall(xfer_key(transfer_id)) or {}
    if not rec:
        raise TransferRefused(f"no KV transfer {transfer_id} is in progress", status=404)
    return {str(k): str(v) for k, v in rec.items()}


def kv_upload_accept(
    *, transfer_id: str, node_id: NodeId, body: BinaryIO, content_length: int | None
) -> dict[str, Any]:
    """Store the old owner's saved slot: only from the node the transfer names, once, size-capped;
    returns the size and the sha256 the controller computed."""
    rec = _record(transfer_id)
    if rec.get("from_node") != str(node_id):
        raise TransferRefused(
            f"node {node_id} may not upload KV transfer {transfer_id}: it is not the primary "
            "that holds the conversation",
            status=403,
        )
    if rec.get("state") != "awaiting_upload":
        raise TransferRefused(f"KV transfer {transfer_id} was already uploaded", status=409)
    cap = int(settings.KV_TRANSFER_MAX_BYTES)
    if content_length is None:
        raise TransferRefused("Content-Length: required for a KV upload", status=411)
    if content_length > cap:
        raise TransferRefused(
            f"Content-Length: {content_length} bytes is over KV_TRANSFER_MAX_BYTES ({cap})",
            status=413,
        )
    blob_dir().mkdir(parents=True, exist_ok=True)
    path = blob_dir() / f"{transfer_id}.bin"
    part = path.with_suffix(".part")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(part, "wb") as out:
            while chunk := body.read(_CHUNK):
                size += len(chunk)
                if size > content_length:
                    raise TransferRefused(
                        f"body: more than the {content_length} bytes Content-Length announced",
                        status=400,
                    )
                digest.update(chunk)
                out.write(chunk)
        if size != content_length:
            raise TransferRefused(
                f"body: {size} bytes, Content-Length announced {content_length}", status=400
            )
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    sha = digest.hexdigest()
    get_redis().hset(
        xfer_key(transfer_id),
        mapping={"state": "uploaded", "size": size, "sha256": sha, "path": str(path)},
    )
    return {"transfer_id": transfer_id, "size": size, "sha256": sha}


def kv_download_open(*, transfer_id: str, node_id: NodeId) -> tuple[Path, int, str]:
    """The uploaded blob, for the node the transfer names as the new owner only."""
    rec = _record(transfer_id)
    if rec.get("to_node") != str(node_id):
        raise TransferRefused(
            f"node {node_id} may not download KV transfer {transfer_id}: it is not the new "
            "owner's primary",
            status=403,
        )
    path = Path(rec.get("path", ""))
    if rec.get("state") != "uploaded" or not path.is_file():
        raise TransferRefused(f"KV transfer {transfer_id} has not been uploaded", status=409)
    return path, int(rec["size"]), rec["sha256"]


# --- the transfer itself -------------------------------------------------------------------------


@dataclass
class Outcome:
    moved: int = 0
    dropped: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _target(dep: Deployment) -> Deployment | None:
    """The replica that takes the conversations: the best other serving one, not draining."""
    candidates = selectors.deployment_route_serving(
        model_id=ids.model_id(dep.model_id), exclude=[dep.id]
    )
    return selectors.deployment_rank(candidates)


def _wait_for_idle(dep: Deployment, deadline: float) -> bool:
    """A slot's state is saved only once the jobs still running on the replica have ended (a job's
    end rewrites what its slot holds); a draining replica takes no new ones."""
    while Job.objects.filter(deployment=dep, state__in=JOB_OPEN).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _wait_for_target(dep: Deployment, deadline: float) -> Deployment | None:
    """Another serving replica, or the drain's replacement once it serves (bounded). None at once
    when no other replica of the model is being placed or loaded: nothing is coming to take the
    state (a one-node cluster's drain would otherwise wait out the whole timeout)."""
    while True:
        target = _target(dep)
        if target is not None or time.monotonic() > deadline:
            return target
        coming = (
            Deployment.objects.filter(model_id=dep.model_id, state__in=list(DEPLOYMENT_PENDING))
            .exclude(pk=dep.pk)
            .exists()
        )
        if not coming:
            return None
        time.sleep(0.5)


def deployment_kv_transfer(*, deployment_id: DeploymentId, now: datetime) -> Outcome:
    """Move every conversation the deployment's slots hold to another serving replica; what cannot
    move is dropped with KV_STATE_DROPPED. Ends the transfer mark and advances the drain."""
    out = Outcome()
    try:
        dep = Deployment.objects.select_related("model").filter(pk=deployment_id).first()
        if dep is None or dep.primary_id is None:
            kvcache.deployment_drop(deployment_id=deployment_id, reason="the replica is gone")
            return out
        timeout = float(settings.KV_TRANSFER_TIMEOUT_SECONDS)
        deadline = time.monotonic() + timeout
        if not _wait_for_idle(dep, deadline):
            out.dropped += kvcache.deployment_drop(
                deployment_id=ids.deployment_id(dep.id),
                reason=f"its jobs still ran after {timeout:g}s",
            )
            return out
        held = kvcache.slots_held(deployment_id=ids.deployment_id(dep.id))
        if not held:
            return out
        target = _wait_for_target(dep, deadline)
        if target is None or target.primary_id is None:
            out.dropped += kvcache.deployment_drop(
                deployment_id=ids.deployment_id(dep.id),
                reason="no other replica serves the model to move it to",
            )
            return out
        for h in held[: int(settings.KV_TRANSFER_MAX_CONVERSATIONS)]:
            try:
                n_bytes, seconds = conversation_transfer(held=h, source=dep, target=target)
            except TransferFailed as exc:
                if kvcache.conversation_drop(
                    deployment_id=ids.deployment_id(dep.id), held=h, reason=str(exc)
                ):
                    out.dropped += 1
                continue
            out.moved += 1
            out.bytes += n_bytes
            out.seconds += seconds
        rest = kvcache.deployment_drop(
            deployment_id=ids.deployment_id(dep.id),
            reason=f"past KV_TRANSFER_MAX_CONVERSATIONS ({settings.KV_TRANSFER_MAX_CONVERSATIONS})",
        )
        out.dropped += rest
        return out
    finally:
        kvcache.transfer_end(deployment_id=deployment_id)
        log.info(
            "kv transfer off deployment %s: %d moved (%d bytes, %.2fs), %d dropped",
            deployment_id,
            out.moved,
            out.bytes,
            out.seconds,
            out.dropped,
        )
        # The transfer held the old replica's stop back (drain.deployments_drain_step): its
        # drain goes on.
        drains_advance(deployments=Deployment.objects.filter(pk=deployment_id), now=now)


class TransferFailed(Exception):
    """One conversation could not be moved; the message says why (it goes into KV_STATE_DROPPED)."""


def _command(
    *, node_id: NodeId, kind: str, payload: dict[str, Any], timeout: float
) -> dict[str, Any]:
    cid = command_send(node_id=node_id, kind=kind, payload=payload)
    result = command_wait(command_id=cid, timeout=timeout)
    if result is None:
        raise TransferFailed(f"{kind}: node {node_id} did not answer within {timeout:g}s")
    if not result.get("ok"):
        raise TransferFailed(f"{kind} on node {node_id} failed: {result.get('error', '?')}")
    return result


def conversation_transfer(
    *, held: kvcache.Held, source: Deployment, target: Deployment
) -> tuple[int, float]:
    """Save one slot on the old primary, restore it into a free slot on the new one and move the
    ownership; (bytes, seconds). Raises TransferFailed."""
    if source.primary_id is None or target.primary_id is None:
        raise TransferFailed("a deployment of the transfer has no primary")
    t0 = time.monotonic()
    timeout = float(settings.KV_TRANSFER_TIMEOUT_SECONDS)
    tid = new_id()
    r = get_redis()
    r.hset(
        xfer_key(tid),
        mapping={
            "from_node": str(source.primary_id),
            "to_node": str(target.primary_id),
            "from_dep": str(source.id),
            "to_dep": str(target.id),
            "state": "awaiting_upload",
        },
    )
    r.expire(xfer_key(tid), XFER_TTL_SECONDS)
    path = ""
    slot: int | None = None
    try:
        saved = _command(
            node_id=ids.node_id(source.primary_id),
            kind="kv_save",
            payload={
                "deployment_id": str(source.id),
                "slot": held.slot,
                "transfer_id": tid,
                "upload_url": f"/api/agent/kv/{tid}",
            },
            timeout=timeout,
        )
        rec = {str(k): str(v) for k, v in (r.hgetall(xfer_key(tid)) or {}).items()}
        path = rec.get("path", "")
        if rec.get("state") != "uploaded":
            raise TransferFailed("the old owner reported a save but its upload never arrived")
        if str(saved.get("sha256", "")).lower() != rec["sha256"]:
            raise TransferFailed(
                f"the old owner's sha256 claim {saved.get('sha256')!r} does not match the "
                f"{rec['size']} bytes it uploaded ({rec['sha256']})"
            )
        _state_check(path=Path(path), held=held, target=target)
        slot = kvcache.slot_reserve(
            deployment_id=ids.deployment_id(target.id),
            n_parallel=int(target.n_parallel or 1),
            transfer_id=tid,
            ttl=timeout + 30,
        )
        if slot is None:
            raise TransferFailed(f"no free slot on the new owner {target.id}")
        restored = _command(
            node_id=ids.node_id(target.primary_id),
            kind="kv_restore",
            payload={
                "deployment_id": str(target.id),
                "slot": slot,
                "transfer_id": tid,
                "url": f"/api/agent/kv/{tid}",
                "sha256": rec["sha256"],
                "size": int(rec["size"]),
            },
            timeout=timeout,
        )
        n_tokens = int(restored.get("n_restored") or 0)
        if n_tokens <= 0:
            raise TransferFailed("the new owner restored no tokens")
        seconds = time.monotonic() - t0
        if not kvcache.conversation_moved(
            held=held,
            from_deployment_id=ids.deployment_id(source.id),
            to_deployment_id=ids.deployment_id(target.id),
            to_slot=slot,
            n_bytes=int(rec["size"]),
            seconds=seconds,
            tokens_restored=n_tokens,
        ):
            raise TransferFailed("the old slot was reused while its state moved")
        return int(rec["size"]), seconds
    finally:
        if slot is not None:
            kvcache.slot_unreserve(
                deployment_id=ids.deployment_id(target.id), slot=slot, transfer_id=tid
            )
        r.delete(xfer_key(tid))
        for p in (path, str(blob_dir() / f"{tid}.bin")):
            if p:
                Path(p).unlink(missing_ok=True)


def _state_check(*, path: Path, held: kvcache.Held, target: Deployment) -> None:
    """The uploaded slot against what the controller knows (TransferFailed names the mismatch)."""
    model_file = target.model_file
    n_layer = int(getattr(model_file, "n_layer", 0) or 0)
    per_token = 0
    if model_file is not None and model_file.profile:
        try:
            profile = ModelProfile.from_dict(model_file.profile)
            per_token = profile.kv_bytes_per_token_per_layer * profile.n_layer
            n_layer = n_layer or profile.n_layer
        except (KeyError, TypeError, ValueError):
            per_token = 0  # a profile this version cannot read: the layer count still holds
    try:
        with open(path, "rb") as fh:
            header = kv_state_read(fh)
        kv_state_check(header, tokens=held.tokens, n_layer=n_layer, bytes_per_token=per_token)
    except KvStateInvalid as exc:
        raise TransferFailed(
            f"the old owner's saved state was refused before any restore: {exc}"
        ) from None


def blob_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            yield chunk
