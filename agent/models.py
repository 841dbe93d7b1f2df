"""Model files on this node: sha256 (cached by path+size+mtime), scanning, resumable fetch."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agent.protocol import ModelFileInfo
from agent.retry import retry_call

log = logging.getLogger("agent.models")
SHA_CACHE_FILE = "sha256-cache.json"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


class ShaCache:
    """sha256 of files keyed by (path, size, mtime): hashing a 40 GB GGUF takes minutes."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / SHA_CACHE_FILE
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, Any]] = {}
        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict):
                self._data = loaded
        except (OSError, ValueError):
            pass

    def sha256(self, path: Path) -> str:
        path = path.resolve()
        st = path.stat()
        key = str(path)
        with self._lock:
            hit = self._data.get(key)
            if hit and hit.get("size") == st.st_size and hit.get("mtime") == st.st_mtime:
                return str(hit["sha256"])
        digest = sha256_file(path)
        with self._lock:
            self._data[key] = {"size": st.st_size, "mtime": st.st_mtime, "sha256": digest}
            self._save()
        return digest

    def _save(self) -> None:
        # Drop entries for files that vanished so the cache does not grow without bound.
        self._data = {k: v for k, v in self._data.items() if os.path.exists(k)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._data, indent=1))
        tmp.replace(self.path)


def scan_models(models_dir: Path, cache: ShaCache) -> list[ModelFileInfo]:
    if not models_dir.is_dir():
        return []
    out: list[ModelFileInfo] = []
    for path in sorted(models_dir.rglob("*.gguf")):
        if not path.is_file():
            continue
        st = path.stat()
        out.append(
            ModelFileInfo(
                path=str(path.resolve()),
                file_name=path.name,
                size=int(st.st_size),
                mtime=float(st.st_mtime),
                sha256=cache.sha256(path),
            )
        )
    return out


MANIFEST = "SHA256SUMS"


def model_dir_digest(path: Path, cache: ShaCache) -> str:
    """A model directory's identity (issue 30): the sha256 of its SHA256SUMS manifest
    (``sha256sum`` lines), after checking every file it lists against its line and that it lists
    every file. Raises ValueError naming the first file that does not match."""
    manifest = path / MANIFEST
    try:
        text = manifest.read_text()
    except OSError as exc:
        raise ValueError(f"{path} has no readable {MANIFEST} manifest: {exc}") from None
    listed: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or "/" in name or name.startswith("."):
            raise ValueError(f"{manifest}: malformed line {line[:80]!r}")
        listed[name] = digest.lower()
    present = {p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST}
    if present != set(listed):
        extra, missing = sorted(present - set(listed)), sorted(set(listed) - present)
        raise ValueError(f"{path}: files not in {MANIFEST}: {extra}; listed but missing: {missing}")
    for name, digest in sorted(listed.items()):
        got = cache.sha256(path / name)
        if got != digest:
            raise ValueError(f"{path / name}: sha256 {got}, the manifest says {digest}")
    return hashlib.sha256(manifest.read_bytes()).hexdigest()


class OutsideModelsDir(ValueError):
    """A command named a path that does not resolve inside the models directory."""


def confined_model_path(models_dir: Path, model_path: str) -> Path:
    """``model_path`` (absolute, or relative to models_dir) resolved, if it lies inside the models
    directory; a symlink the owner put there may name a file elsewhere, and that file is allowed.
    Raises OutsideModelsDir otherwise: a command never reads a file the owner did not offer."""
    root = models_dir.resolve()
    p = Path(model_path)
    real = (p if p.is_absolute() else models_dir / p).resolve()
    if real.is_relative_to(root):
        return real
    if models_dir.is_dir():
        # A GGUF linked anywhere below, or a link placed in the models directory itself (a vLLM
        # model directory offered as a link to where it was converted: issue 30).
        for link in [*models_dir.rglob("*.gguf"), *models_dir.iterdir()]:
            if link.is_symlink() and link.resolve() == real:
                return real
    raise OutsideModelsDir(f"{model_path!r} is outside the models directory {root}")


def resolve_model(
    models_dir: Path, cache: ShaCache, *, sha256: str, model_path: str | None
) -> Path | None:
    """The local file for a plan: its explicit path (confined to models_dir: OutsideModelsDir),
    else a file in models_dir with that sha."""
    if model_path:
        p = confined_model_path(models_dir, model_path)
        return p if p.is_file() else None
    for info in scan_models(models_dir, cache):
        if info["sha256"] == sha256:
            return Path(info["path"])
    return None


class FetchError(Exception):
    pass


def safe_file_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise FetchError(f"refusing model file name {name!r}: must be a plain file name")
    return name


def fetch_model(
    *,
    url: str,
    dest_dir: Path,
    file_name: str,
    sha256: str,
    size: int | None,
    headers: dict[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    stop: threading.Event | None = None,
    attempts: int = 2,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Download with HTTP Range resume, verify sha256; retry once from scratch on a mismatch.

    A file that fails verification is deleted: a bad model on disk would be served later.
    """
    sha256 = sha256.lower()
    if not _SHA_RE.match(sha256):
        raise FetchError(f"fetch_model: sha256 must be 64 hex digits, got {sha256!r}")
    dest = dest_dir / safe_file_name(file_name)
    part = dest.with_name(dest.name + ".part")
    dest_dir.mkdir(parents=True, exist_ok=True)
    if dest.is_file() and sha256_file(dest) == sha256:
        return dest
    last_error = ""
    tries = 0

    def attempt() -> Path:
        nonlocal last_error, tries
        tries += 1
        try:
            _download(url, part, headers or {}, transport, stop, progress)
        except httpx.HTTPError as exc:
            last_error = f"download failed: {exc}"
            log.warning("fetch %s attempt %d: %s", file_name, tries, last_error)
            raise _AttemptFailed from None  # the .part stays: the next attempt resumes it
        got_size = part.stat().st_size
        if size is not None and size > 0 and got_size != size:
            last_error = f"size mismatch: expected {size} bytes, got {got_size}"
        else:
            digest = sha256_file(part)
            if digest == sha256:
                os.replace(part, dest)
                return dest
            last_error = f"sha256 mismatch: expected {sha256}, got {digest}"
        log.warning("fetch %s attempt %d: %s; discarding the file", file_name, tries, last_error)
        part.unlink(missing_ok=True)
        raise _AttemptFailed

    try:
        # No pause between attempts: the second one resumes or starts over at once.
        return retry_call(attempt, retry_on=_AttemptFailed, base=0.0, cap=0.0, attempts=attempts)
    except _AttemptFailed:
        part.unlink(missing_ok=True)
        raise FetchError(
            f"fetch_model {file_name} failed after {attempts} attempts: {last_error}"
        ) from None


class _AttemptFailed(Exception):
    """One download attempt failed; last_error says why."""


def _download(
    url: str,
    part: Path,
    headers: dict[str, str],
    transport: httpx.BaseTransport | None,
    stop: threading.Event | None,
    progress: Callable[[int], None] | None,
) -> None:
    have = part.stat().st_size if part.exists() else 0
    req_headers = dict(headers)
    if have:
        req_headers["Range"] = f"bytes={have}-"
    with httpx.Client(transport=transport, timeout=httpx.Timeout(30.0, connect=10.0)) as http:
        with http.stream("GET", url, headers=req_headers, follow_redirects=True) as resp:
            if resp.status_code == 416:  # asked past the end: the part is already complete
                return
            resp.raise_for_status()
            mode = "ab" if have and resp.status_code == 206 else "wb"
            with open(part, mode) as f:
                for block in resp.iter_bytes():  # as it arrives: a drop keeps what came
                    if stop is not None and stop.is_set():
                        raise httpx.ReadError("stopped by agent shutdown")
                    f.write(block)
                    if progress:
                        progress(len(block))
