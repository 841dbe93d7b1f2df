"""Signed receipts: one per node paid by a settlement, and the controller's receipt key."""

from __future__ import annotations

import base64
import functools
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings

from racon.ids import NodeId

from . import signing
from .models import Entry, Receipt
from .rules import share_ppm

log = logging.getLogger("racon.credits")


@dataclass
class Payout:
    node_id: NodeId
    owner_id: str
    amount: int
    escrowed: bool
    layers: int = 0
    device_ms: int | None = None
    primary: bool = False


def receipts_issue(
    *,
    entry: Entry,
    job: Any,
    nodes: dict[str, Any],
    payouts: list[Payout],
    value: int,
    now: datetime,
) -> list[Receipt]:
    """One signed receipt per participating node, in the settlement's transaction."""
    key = receipt_signing_key()
    kid = signing.key_id(key)
    out = []
    for p in payouts:
        rid = uuid.uuid4()
        payload = {
            "version": signing.RECEIPT_VERSION,
            "receipt_id": str(rid),
            "key_id": kid,
            "job_id": str(job.pk),
            "job_state": job.state,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
            "node_id": p.node_id,
            "node_name": nodes[p.node_id].name,
            "account_id": p.owner_id,
            "model": job.model.name,
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "tokens": job.prompt_tokens + job.completion_tokens,
            "layers": p.layers,
            "device_ms": p.device_ms,
            "primary": p.primary,
            "job_value": value,
            "share_ppm": share_ppm(p.amount, value),
            "credits": p.amount,
            "escrowed": p.escrowed,
            "entry_id": entry.pk,
            "issued_at": now.isoformat(),
        }
        out.append(
            Receipt(
                id=rid,
                entry=entry,
                job_id=job.pk,
                node_id=p.node_id,
                account_id=p.owner_id,
                model_name=job.model.name,
                tokens=payload["tokens"],
                layers=p.layers,
                share_ppm=payload["share_ppm"],
                credits=p.amount,
                escrowed=p.escrowed,
                is_primary=p.primary,
                issued_at=now,
                payload=payload,
                signature=signing.receipt_sign(payload, key),
                key_id=kid,
            )
        )
    return Receipt.objects.bulk_create(out)


def receipt_signing_key() -> Ed25519PrivateKey:
    """The controller's receipt key: RACON_RECEIPT_KEY (base64 raw), else VAR_DIR/receipt-signing.key (made 0600)."""
    configured = settings.RACON_RECEIPT_KEY
    if configured:
        return _key_from_b64(configured)
    # None (a test's override) falls back to the default place.
    path = settings.CREDITS_RECEIPT_KEY_PATH or Path(settings.VAR_DIR) / "receipt-signing.key"
    return _key_from_file(str(path))


@functools.lru_cache(maxsize=4)
def _key_from_b64(text: str) -> Ed25519PrivateKey:
    return signing.private_key_from_b64(text)


@functools.lru_cache(maxsize=8)
def _key_from_file(path_str: str) -> Ed25519PrivateKey:
    path = Path(path_str)
    try:
        return signing.private_key_from_b64(path.read_text())
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = signing.private_key_generate()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".receipt-signing-")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(signing.private_key_to_b64(key) + "\n")
        try:
            # link() never replaces: if another process created the key first, its key wins.
            os.link(tmp, path)
        except FileExistsError:
            key = signing.private_key_from_b64(path.read_text())
    finally:
        os.unlink(tmp)
    log.info("created receipt signing key %s (key id %s)", path, signing.key_id(key))
    return key


def receipt_public_key() -> dict[str, str]:
    """The public half of the receipt key, for offline verification."""
    key = receipt_signing_key()
    return {
        "algorithm": signing.ALGORITHM,
        "key_id": signing.key_id(key),
        "public_key": base64.b64encode(signing.public_key_raw(key)).decode(),
        "pem": signing.public_key_pem(key),
    }


def receipt_check(*, receipt: Any) -> signing.VerifyResult:
    """Verify a receipt against this controller's public key: any altered field fails."""
    return signing.receipt_verify(receipt, receipt_signing_key().public_key())
