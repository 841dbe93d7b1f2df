"""Where the CLI finds its controller and key: flags, then RACON_URL / RACON_API_KEY, then the file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


def default_config_path() -> Path:
    env = os.environ.get("RACON_CONFIG")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "racon" / "config.json"


@dataclass(frozen=True)
class Settings:
    url: str
    key: str
    path: Path


class ConfigError(Exception):
    """The config file is unreadable or missing what a command needs."""


def load(path: Path | None = None, *, url: str | None = None, key: str | None = None) -> Settings:
    """Flags win over the environment, which wins over the file."""
    path = path or default_config_path()
    stored: dict[str, str] = {}
    if path.exists():
        try:
            stored = json.loads(path.read_text() or "{}")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        if not isinstance(stored, dict):
            raise ConfigError(f"{path} is not a JSON object")
    return Settings(
        url=(url or os.environ.get("RACON_URL") or stored.get("url") or "").rstrip("/"),
        key=key or os.environ.get("RACON_API_KEY") or stored.get("key") or "",
        path=path,
    )


def save(path: Path, *, url: str, key: str) -> None:
    """Write the file readable by its owner only (it holds an API key)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url.rstrip("/"), "key": key}, fh, indent=2)
        fh.write("\n")
    os.chmod(tmp, 0o600)  # O_CREAT's mode is masked by the umask; be explicit
    tmp.replace(path)
