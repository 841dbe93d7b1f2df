"""Receipt signing and offline verification (Ed25519). Pure: no Django, so the CLI reuses it.

A receipt is a flat JSON object of strings, integers, booleans and nulls (never floats, so every
implementation serialises it identically) plus a ``signature`` field. The signature covers the
canonical JSON of every other field: sorted keys, no spaces, UTF-8.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

RECEIPT_VERSION = 1
ALGORITHM = "Ed25519"


@dataclass(frozen=True)
class VerifyResult:
    valid: bool
    reason: str


def canonical_json(obj: Any) -> bytes:
    """The exact bytes a signature covers: sorted keys, compact separators, UTF-8, no floats."""
    _refuse_floats(obj)
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _refuse_floats(obj: Any) -> None:
    # Floats print differently across languages and versions; a receipt must re-serialise exactly.
    if isinstance(obj, float):
        raise ValueError("receipts carry integers only (floats do not serialise canonically)")
    if isinstance(obj, Mapping):
        for value in obj.values():
            _refuse_floats(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _refuse_floats(value)


def private_key_generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_to_b64(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(
        encoding=serialization.Encoding.Raw,
        format=serialization.PrivateFormat.Raw,
        encryption_algorithm=serialization.NoEncryption(),
    )
    return base64.b64encode(raw).decode()


def private_key_from_b64(text: str) -> Ed25519PrivateKey:
    """A private key from base64 of its 32 raw bytes (the RACON_RECEIPT_KEY format)."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"receipt signing key is not base64: {exc}") from None
    if len(raw) != 32:
        raise ValueError(f"receipt signing key must be 32 raw bytes, got {len(raw)}")
    return Ed25519PrivateKey.from_private_bytes(raw)


def public_key_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(
        encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw
    )


def public_key_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(
        encoding=serialization.Encoding.PEM, format=serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short fingerprint of the public key, written into each receipt (which key signed it)."""
    return hashlib.sha256(public_key_raw(key)).hexdigest()[:16]


def public_key_load(data: str | bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    """A public key from PEM, or base64 of its 32 raw bytes (both as GET /api/credits/public-key gives)."""
    if isinstance(data, Ed25519PublicKey):
        return data
    text = data.decode() if isinstance(data, bytes) else data
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the PEM key is not an Ed25519 public key")
        return key
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"public key is neither PEM nor base64: {exc}") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 raw bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def receipt_sign(payload: Mapping[str, Any], private_key: Ed25519PrivateKey) -> str:
    """Base64 signature over the canonical JSON of ``payload`` (which must not hold ``signature``)."""
    if "signature" in payload:
        raise ValueError("sign the payload, not a signed receipt")
    return base64.b64encode(private_key.sign(canonical_json(dict(payload)))).decode()


def receipt_verify(
    receipt: Mapping[str, Any], public_key: str | bytes | Ed25519PublicKey
) -> VerifyResult:
    """Whether ``receipt`` (payload fields plus ``signature``) was signed by ``public_key``, unaltered."""
    if not isinstance(receipt, Mapping):
        return VerifyResult(False, "a receipt is a JSON object")
    try:
        pub = public_key_load(public_key)
    except ValueError as exc:
        return VerifyResult(False, f"unusable public key: {exc}")
    signature = receipt.get("signature")
    if not isinstance(signature, str) or not signature:
        return VerifyResult(False, "missing signature")
    try:
        sig = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        return VerifyResult(False, "signature is not base64")
    if len(sig) != 64:
        return VerifyResult(False, "signature has the wrong length")
    payload = {k: v for k, v in receipt.items() if k != "signature"}
    if payload.get("version") != RECEIPT_VERSION:
        return VerifyResult(False, f"unsupported receipt version {payload.get('version')!r}")
    claimed = payload.get("key_id")
    if claimed is not None and claimed != key_id(pub):
        return VerifyResult(False, f"signed by another key ({claimed}, this key is {key_id(pub)})")
    try:
        message = canonical_json(payload)
    except (ValueError, TypeError) as exc:
        return VerifyResult(False, f"not a canonical receipt: {exc}")
    try:
        pub.verify(sig, message)
    except InvalidSignature:
        return VerifyResult(False, "signature does not match the receipt (altered, or not ours)")
    return VerifyResult(True, "ok")
