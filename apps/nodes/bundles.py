"""The standalone agent bundle the join line installs (issue 26): one folder, no Python needed.

GET /join/<token>/bundle.txt?machine=<uname -m>&flags=<cpu flags>   the bundle for that machine,
GET /api/agent/bundle.txt?...   (Authorization: Node id:cred)       as `key=value` lines a POSIX
                                                                     sh reads (no JSON parser)
GET/POST /api/admin/bundles     (staff) list; upload a bundle built on another platform

Bundles live beside the wheelhouse: <wheelhouse>/bundles/<platform key>/ holds the tarball and a
manifest.json (sha256, size, platform, machine, glibc floor) that scripts/build-bundle.sh writes,
so the wheelhouse's file view serves it (GET /join/files/bundles/<platform>/<name>). A bundle runs
on a machine of the same architecture whose CPU has every feature its llama.cpp was compiled for
(the platform key names them) and whose glibc is at least the bundle's floor; the join line checks
the last one itself, before it writes anything. This controller builds its own platform's bundle
when a join asks for it and it is missing or older than agent/ (503-like `wait=` answer meanwhile).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from . import join

log = logging.getLogger("racon.nodes.bundles")

BUILDER = settings.BASE_DIR / "scripts" / "build-bundle.sh"
_MACHINE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_FLAG_RE = re.compile(r"^[a-z0-9_.]{1,40}$")
_NAME_RE = re.compile(r"^node-agent-[A-Za-z0-9_.+-]{1,200}\.tar\.gz$")
_build_lock = threading.Lock()
_build: dict[str, subprocess.Popen[bytes]] = {}
_build_failed_at: dict[int, float] = {}  # id(failed build) -> when it was first seen failed
RETRY_AFTER_SECONDS = 60.0
HOW_TO_BUILD = (
    "build one on a machine like this one with `racon bundle build` (from a checkout: "
    "scripts/build-bundle.sh) and have the operator upload it with `racon bundle upload FILE`; "
    "or join through Python 3.12+ with RACON_JOIN_ROUTE=python"
)


def bundles_root() -> Path:
    return join.wheelhouse_root() / "bundles"


def key_features(platform: str) -> tuple[str, str, set[str]]:
    """(os, machine, CPU features) of a platform key: linux-x86_64-avx-avx2-...-cpu-rpc[-vulkan]."""
    parts = platform.split("-")
    osname, machine = (parts + ["", ""])[:2]
    rest = parts[2:]
    feats = rest[: rest.index("cpu")] if "cpu" in rest else rest
    return osname, machine, set(feats)


def bundles() -> list[dict[str, Any]]:
    """Every bundle this controller can serve: its manifest plus the platform directory."""
    return join.bundle_manifests()


def summaries() -> list[dict[str, Any]]:
    """What the wheelhouse manifest and GET /api/admin/bundles list of each bundle."""
    return join.bundle_summaries()


def pick(machine: str, flags: set[str]) -> tuple[dict[str, Any] | None, str]:
    """The fastest bundle this machine can run, or None and the one line that says why not."""
    have = bundles()
    usable = [
        b for b in have if b.get("machine") == machine and key_features(b["platform"])[2] <= flags
    ]
    if usable:
        return max(usable, key=lambda b: len(key_features(b["platform"])[2])), ""
    if not have:
        return None, f"the controller has no agent bundle yet; {HOW_TO_BUILD}"
    same = [b for b in have if b.get("machine") == machine]
    if same:
        missing = sorted(key_features(same[0]["platform"])[2] - flags)
        return None, (
            f"this machine's {machine} CPU lacks {', '.join(missing)}, which the controller's "
            f"agent bundle ({same[0]['platform']}) is compiled for; {HOW_TO_BUILD}"
        )
    theirs = ", ".join(f"{b['machine']} ({b['platform']})" for b in have)
    return None, (
        f"this machine is {machine}, and the controller has agent bundles for {theirs} only; "
        f"{HOW_TO_BUILD}"
    )


def own_platform_key() -> str:
    """The platform of the bundle this controller builds: its llama.cpp build's (the venv's
    llama.cpp link, what scripts/build-bundle.sh bundles), else this machine's key."""
    try:
        return (Path(sys.prefix) / "llama.cpp" / "PLATFORM").read_text().strip()
    except OSError:
        return join.own_platform()[0]


def _stale(bundle: dict[str, Any]) -> bool:
    """Older than agent/ as it is on disk now (what scripts/build-bundle.sh builds from): not the
    running controller's own cached hash, or an edit after its start would rebuild in a loop."""
    return getattr(settings, "JOIN_REBUILD", True) and (
        bundle.get("agent_source") != join.agent_source_hash.__wrapped__()
    )


def start_build() -> bool:
    """Start scripts/build-bundle.sh for this controller's platform unless it runs; True while
    it runs."""
    with _build_lock:
        proc = _build.get("proc")
        if proc is not None and proc.poll() is None:
            return True
        if proc is not None and proc.returncode != 0:
            # A failed build is not retried in a loop (its log says why), but once the last try is
            # RETRY_AFTER_SECONDS old: a transient failure must not need a controller restart.
            failed_at = _build_failed_at.setdefault(id(proc), time.monotonic())
            if time.monotonic() - failed_at < RETRY_AFTER_SECONDS:
                return False
        log_path = Path(settings.VAR_DIR) / "build-bundle.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("building the agent bundle for %s, log: %s", own_platform_key(), log_path)
        with open(log_path, "ab") as out:
            _build["proc"] = subprocess.Popen(
                [str(BUILDER)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "RACON_WHEELHOUSE_DIR": str(join.wheelhouse_root())},
            )
        return True


def _lines(**fields: object) -> HttpResponse:
    body = "".join(f"{k}={v}\n" for k, v in fields.items() if v is not None)
    resp = HttpResponse(body, content_type="text/plain; charset=utf-8")
    resp["Cache-Control"] = "no-store"
    return resp


def bundle_answer(request: HttpRequest, files_url: str) -> HttpResponse:
    """The `key=value` answer: the bundle (url, sha256, size, machine, glibc, ...), `wait=` while
    this controller builds its own, or `error=` with one line (200 either way: the sh reads it)."""
    machine = request.GET.get("machine", "")
    flags = {f for f in re.split(r"[ ,]+", request.GET.get("flags", "")) if _FLAG_RE.match(f)}
    if not _MACHINE_RE.match(machine):
        return _lines(error="machine must be what `uname -m` prints, e.g. x86_64", code=2)
    own = own_platform_key()
    own_osname, own_machine, own_feats = key_features(own)
    mine = next((b for b in bundles() if b.get("platform") == own), None)
    could_use_own = machine == own_machine and own_feats <= flags
    if could_use_own and (mine is None or _stale(mine)) and getattr(settings, "JOIN_REBUILD", True):
        if start_build():
            return _lines(
                wait=5,
                message=f"the controller is building the agent bundle for {own} (the first join "
                "after the agent changed; about 2 minutes)",
            )
        if mine is None:
            return _lines(
                error="the controller could not build its agent bundle; see "
                f"{Path(settings.VAR_DIR) / 'build-bundle.log'}",
                code=1,
            )
    bundle, why = pick(machine, flags)
    if bundle is None:
        return _lines(error=why, code=6)
    f = bundle["files"][0]
    return _lines(
        url=f"{files_url}/bundles/{bundle['dir']}/{f['name']}",
        name=f["name"],
        sha256=f["sha256"],
        size=f["size"],
        unpacked=bundle.get("unpacked_size", f["size"] * 3),
        machine=bundle.get("machine"),
        glibc=bundle.get("glibc"),
        platform=bundle.get("platform"),
        agent_version=bundle.get("agent_version"),
    )


@require_GET
def join_bundle(request: HttpRequest, token: str) -> HttpResponse:
    problem = join.token_problem(token=token)
    if problem:
        return _lines(error=problem, code=1)
    return bundle_answer(request, "/join/files")


@require_GET
def join_ca(request: HttpRequest, token: str) -> HttpResponse:
    """The controller's CA certificate (the sh route fetches it over the line's pinned channel and
    hands it to the agent as RACON_CA_FILE, as the join program does with its copy)."""
    problem = join.token_problem(token=token)
    path = getattr(settings, "TLS_CA_FILE", None)
    if problem or not path:
        return HttpResponse(problem or "no CA", status=404, content_type="text/plain")
    try:
        pem = Path(path).read_text()
    except OSError:
        return HttpResponse("the controller's CA cannot be read", status=404)
    return HttpResponse(pem, content_type="application/x-pem-file")


@require_GET
def upgrade_bundle(request: HttpRequest) -> HttpResponse:
    problem = join._authorized(request)
    if problem:
        return _lines(error=problem, code=1)
    return bundle_answer(request, "/api/agent/wheelhouse/files")


# --- upload (operators) ----------------------------------------------------------------------


def read_bundle_info(data: bytes) -> dict[str, Any]:
    """node-agent/BUNDLE.json of an uploaded tarball (ValueError with one line when it is not a
    bundle)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            member = tar.extractfile("node-agent/BUNDLE.json")
            info = json.loads(member.read()) if member else None
            names = set(tar.getnames())
    except (tarfile.TarError, KeyError, OSError, ValueError) as exc:
        raise ValueError(
            f"not an agent bundle (scripts/build-bundle.sh's tarball): {exc}"
        ) from None
    if not isinstance(info, dict) or "node-agent/node-agent" not in names:
        raise ValueError("not an agent bundle: node-agent/BUNDLE.json or the executable is missing")
    for k in ("platform", "machine", "glibc", "agent_version"):
        if not isinstance(info.get(k), str) or not info[k]:
            raise ValueError(f"the bundle's BUNDLE.json lacks {k}")
    if not join._KEY_RE.match(info["platform"]) or not _MACHINE_RE.match(info["machine"]):
        raise ValueError("the bundle's BUNDLE.json names an invalid platform or machine")
    if not re.match(r"^2\.[0-9]{1,3}(\.[0-9]{1,3})?$", info["glibc"]):
        raise ValueError("the bundle's BUNDLE.json names an invalid glibc floor")
    return info


def store_bundle(data: bytes, name: str) -> dict[str, Any]:
    """Write an uploaded bundle and its manifest under bundles/<platform>/ (replacing that
    platform's previous one). Returns the manifest."""
    if not _NAME_RE.match(name):
        raise ValueError("the file name must be node-agent-<version>-<machine>-<key>.tar.gz")
    info = read_bundle_info(data)
    dest = bundles_root() / info["platform"]
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{name}.tmp"
    tmp.write_bytes(data)
    tmp.replace(dest / name)
    for old in dest.glob("node-agent-*.tar.gz"):
        if old.name != name:
            old.unlink()
    manifest = {
        "kind": "bundle",
        "agent_version": info["agent_version"],
        "agent_source": info.get("agent_source", "uploaded"),
        "platform": info["platform"],
        "machine": info["machine"],
        "glibc": info["glibc"],
        "python": info.get("python", ""),
        "uploaded": True,
        "files": [
            {
                "name": name,
                "kind": "bundle",
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ],
    }
    (dest / ".manifest.json.tmp").write_text(json.dumps(manifest, indent=1) + "\n")
    (dest / ".manifest.json.tmp").replace(dest / "manifest.json")
    return manifest


MAX_UPLOAD = 1 << 30


class BundleApi(APIView):
    """GET /api/admin/bundles: the bundles this controller serves. POST /api/admin/bundles?name=
    <file name>, the tarball as the body (application/gzip): add or replace one (operators)."""

    parser_classes: list[Any] = []  # the body is the tarball itself, read below

    @extend_schema(responses={200: serializers.ListSerializer(child=serializers.DictField())})
    def get(self, request: Request) -> Response:
        return Response(summaries())

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},  # a .tar.gz, any type
        parameters=[
            OpenApiParameter(
                "name", str, required=False, description="the tarball's file name, as built"
            )
        ],
        responses={201: OpenApiTypes.OBJECT, 400: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request) -> Response:
        raw = request._request
        size = int(raw.META.get("CONTENT_LENGTH") or 0)
        if not 0 < size <= MAX_UPLOAD:
            return Response(
                {
                    "error": {
                        "message": "send the bundle's tarball as the body",
                        "code": "bad_bundle",
                    }
                },
                status=400,
            )
        try:
            manifest = store_bundle(raw.read(size), request.query_params.get("name", ""))
        except ValueError as exc:
            return Response({"error": {"message": str(exc), "code": "bad_bundle"}}, status=400)
        log.info("agent bundle for %s uploaded", manifest["platform"])
        return Response(manifest, status=201)
