"""The stored node credential and command key (mode 0600) and a stable machine id, in the state dir."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

IDENTITY_FILE = "identity.json"
MACHINE_ID_FILE = "machine-id"


@dataclass
class Identity:
    node_id: str
    credential: str
    controller_url: str
    redis_url: str
    node_name: str = ""
    enrolled_at: float = field(default_factory=time.time)
    # Hex; the key the controller signs this node's commands with (agent/protocol.py). Empty in an
    # identity stored before commands were signed, until a heartbeat answer brings it.
    command_key: str = ""

    def auth_header(self) -> str:
        return f"Node {self.node_id}:{self.credential}"

    def command_key_bytes(self) -> bytes | None:
        try:
            key = bytes.fromhex(self.command_key)
        except ValueError:
            return None
        return key if len(key) >= 16 else None


class IdentityError(ValueError):
    pass


def ensure_private_dir(path: Path) -> Path:
    """Create the state dir readable by its owner only: it holds a credential."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass  # not ours (e.g. a shared mount); the credential file itself is still 0600
    return path


def write_private_file(path: Path, data: str | bytes) -> None:
    """Atomically write a file created with mode 0600 from the start (no readable window)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # umask cannot widen it, but an old tmp file might have
        os.write(fd, raw)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def save_identity(state_dir: Path, identity: Identity) -> Path:
    ensure_private_dir(state_dir)
    path = state_dir / IDENTITY_FILE
    write_private_file(path, json.dumps(asdict(identity), indent=2) + "\n")
    return path


def load_identity(state_dir: Path) -> Identity | None:
    """The stored identity, or None when absent. A corrupt file raises IdentityError."""
    path = state_dir / IDENTITY_FILE
    try:
        raw: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise IdentityError(f"cannot read {path}: {exc}") from exc
    try:
        return Identity(
            node_id=str(raw["node_id"]),
            credential=str(raw["credential"]),
            controller_url=str(raw["controller_url"]),
            redis_url=str(raw["redis_url"]),
            node_name=str(raw.get("node_name", "")),
            enrolled_at=float(raw.get("enrolled_at", 0.0)),
            command_key=str(raw.get("command_key", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise IdentityError(f"{path} is missing field {exc}") from exc


def machine_id(state_dir: Path, *, etc_machine_id: Path = Path("/etc/machine-id")) -> str:
    """A stable id for (this host, this state dir).

    Two agents on one host with different state dirs are different machines to the controller
    (tests and multi-tenant hosts do this), so the host id is salted with the state dir path.
    The result is persisted so that moving /etc/machine-id later does not change identity.
    """
    ensure_private_dir(state_dir)
    stored = state_dir / MACHINE_ID_FILE
    try:
        value = stored.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    try:
        host = etc_machine_id.read_text().strip()
    except OSError:
        host = ""
    if host:
        salt = str(state_dir.resolve())
        value = hashlib.sha256(f"{host}:{salt}".encode()).hexdigest()[:32]
    else:
        value = uuid.uuid4().hex
    write_private_file(stored, value + "\n")
    return value
