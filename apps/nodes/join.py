"""Joining in one command: `curl -fsSLk --pinnedpubkey sha256//<pin> CONTROLLER/join/<token> | sh`.

A LAN controller (`BIND=<address> make run`) serves HTTPS with a certificate from its own CA
(racon/tls.py): the line pins the server key, join.sh fetches the join program with the same
pin, and the join program carries the CA, against which it checks every later fetch (the
manifest, the files) and which the agent keeps for every https and rediss connection. A
controller on loopback, or behind a proxy with a public certificate, gives `curl -fsSL URL | sh`.
A non-loopback plain-http controller gives no line unless RACON_INSECURE_LAN=1
(docs/design/serving.md, "LAN and trust").

GET /join/<token>                 a POSIX sh script (finds Python 3.12+, runs the program below)
GET /join/<token>.py              the join program (packaging/join/join.py) for this token
GET /join/<token>/manifest.json   ?platform=<key>&abi=<cp312>: the files to fetch, with sha256
GET /join/files/<dir>/<name>      one file of the wheelhouse (Authorization: Join <token>)
GET /api/agent/wheelhouse/manifest.json, /api/agent/wheelhouse/files/<dir>/<name>
                                  the same for `node-agent upgrade` (Authorization: Node id:cred)

The wheelhouse is built by scripts/build-wheelhouse.py into ~/.cache/racon/wheelhouse (RACON_CACHE,
or the JOIN_WHEELHOUSE_DIR setting): one directory per platform key and Python ABI, plus source/ for
machines that must build llama.cpp themselves. A join that finds this controller's own wheelhouse
missing or older than agent/ starts that build once and gets 503 with Retry-After meanwhile.

The token is only read here, never consumed: enrollment (POST /api/agent/enroll) consumes it, so a
failed run can be retried, and the join URL dies with the token (expired, revoked, used up).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from agent.protocol import PROTOCOL_VERSION
from racon.lan import is_loopback_host

from .enrollment import EnrollmentError, NodeAuthError, enrollment_token_hash, node_authenticate
from .models import EnrollmentToken

log = logging.getLogger("racon.nodes.join")

JOIN_DIR = settings.BASE_DIR / "packaging" / "join"
BUILDER = settings.BASE_DIR / "scripts" / "build-wheelhouse.py"
_KEY_RE = re.compile(r"^[a-z0-9_.-]{1,300}$")
_ABI_RE = re.compile(r"^cp3[0-9]{1,2}$")
_build_lock = threading.Lock()
_build: dict[str, subprocess.Popen[bytes]] = {}


def wheelhouse_root() -> Path:
    explicit = getattr(settings, "JOIN_WHEELHOUSE_DIR", None)
    if explicit:
        return Path(explicit)
    cache_dir = os.environ.get("RACON_CACHE") or str(Path.home() / ".cache" / "racon")
    return Path(cache_dir) / "wheelhouse"


def bundle_manifests() -> list[dict[str, Any]]:
    """The standalone agent bundles beside the wheelhouse (bundles/<platform>/manifest.json, by
    scripts/build-bundle.sh or an upload; apps/nodes/bundles.py serves them), each with its dir."""
    out = []
    root = wheelhouse_root() / "bundles"
    for path in sorted(root.glob("*/manifest.json")) if root.is_dir() else []:
        m = _read_manifest(path.parent)
        files = (m or {}).get("files") or []
        if (
            m
            and files
            and isinstance(files[0], dict)
            and (path.parent / files[0]["name"]).is_file()
        ):
            out.append({**m, "dir": path.parent.name})
    return out


def bundle_summaries() -> list[dict[str, Any]]:
    """What the wheelhouse manifest lists of each bundle: platform, machine, glibc floor, file."""
    keys = ("platform", "machine", "glibc", "agent_version", "agent_source")
    return [
        {**{k: b.get(k) for k in keys}, **{k: b["files"][0][k] for k in ("name", "size", "sha256")}}
        for b in bundle_manifests()
    ]


# --- the lines shown with a new token ------------------------------------------------------------


def join_url(*, token: str) -> str:
    return f"{settings.CONTROLLER_PUBLIC_URL}/join/{token}"


# On a failed fetch curl writes this to the pipe instead of a script (`-w '%{onerror}…'`), so
# `| sh` says why in one line and exits non-zero rather than running an empty script with 0.
PIN_MISMATCH = "the controller's certificate does not match the pin in this line"
_ON_ERROR = (
    '%{onerror}[ %{exitcode} = 90 ] && echo "racon join: error: ' + PIN_MISMATCH + '" >&2 || '
    'echo "racon join: error: curl: %{errormsg}" >&2; exit 1'
)


def insecure_problem() -> str | None:
    """Why this controller gives no join line (plain http on a non-loopback address), or None."""
    url = settings.CONTROLLER_PUBLIC_URL
    if not url.startswith("http://") or settings.INSECURE_LAN:
        return None
    if is_loopback_host(urlsplit(url).hostname or ""):
        return None
    return (
        f"this controller's URL {url} is plain http on a network: the join would send the token "
        "and install software over an unauthenticated channel. Start it with `BIND=<LAN address> "
        "make run` (HTTPS with a pinned join line), or set RACON_INSECURE_LAN=1 to accept that risk"
    )


def join_command_line(*, token: str) -> str:
    problem = insecure_problem()
    if problem:
        return f"# no join line: {problem}"
    url = shlex.quote(join_url(token=token))
    pin = settings.TLS_PIN
    if pin and url.startswith("https://"):
        return f"curl -fsSLk --pinnedpubkey {pin} {url} -w {shlex.quote(_ON_ERROR)} | sh"
    return f"curl -fsSL {url} | sh"


# The Python route's bootstrap: connect without CA checks, take the server's certificate, find its
# SubjectPublicKeyInfo in the DER (a few TLV steps), and compare its sha256 with the pin before
# a single byte of the program is run. Sent base64-encoded; URL and PIN stay readable in the line.
_PY_PINNED = (
    "import ssl,sys,hashlib,base64,http.client as h,urllib.parse as p\n"
    "def L(d,i):\n n=d[i+1];i+=2\n if n>127:k=n-128;n=int.from_bytes(d[i:i+k],'big');i+=k\n return i,n\n"
    "def S(d):\n i,_=L(d,0);i,_=L(d,i)\n if d[i]==160:j,n=L(d,i);i=j+n\n"
    " for _ in range(5):j,n=L(d,i);i=j+n\n j,n=L(d,i);return d[i:j+n]\n"
    "U=p.urlsplit(URL);c=ssl.create_default_context();c.check_hostname=False;c.verify_mode=ssl.CERT_NONE\n"
    "C=h.HTTPSConnection(U.hostname,U.port or 443,context=c,timeout=60);C.connect()\n"
    "if 'sha256//'+base64.b64encode(hashlib.sha256(S(C.sock.getpeercert(True))).digest()).decode()!=PIN:"
    "sys.exit('racon join: error: " + PIN_MISMATCH.replace("'", "\\'") + "')\n"
    "C.request('GET',U.path);R=C.getresponse()\n"
    "if R.status!=200:sys.exit('racon join: error: HTTP %d' % R.status)\n"
    "exec(R.read())"
)


def join_python_line(*, token: str) -> str:
    url = join_url(token=token) + ".py"
    pin = settings.TLS_PIN
    if insecure_problem():
        return join_command_line(token=token)
    if pin and url.startswith("https://"):
        boot = base64.b64encode(_PY_PINNED.encode()).decode()
        return (
            f"python3 -c \"URL='{url}';PIN='{pin}';import base64;exec(base64.b64decode('{boot}'))\""
        )
    return f"python3 -c \"import urllib.request as u; exec(u.urlopen('{url}').read())\""


# --- the token -----------------------------------------------------------------------------------


def token_problem(*, token: str) -> str | None:
    """Why this join link no longer works, or None. Reads the token; never consumes it."""
    try:
        digest = enrollment_token_hash(token)
    except EnrollmentError as exc:
        return str(exc)
    tok = EnrollmentToken.objects.filter(token_hash=digest).first()
    again = "ask the controller's administrator for a new join line"
    if tok is None:
        return f"this join link's enrollment token is invalid (unknown to this controller); {again}"
    if tok.revoked_at is not None:
        return f"the enrollment token {tok.prefix}… of this join link has been revoked; {again}"
    if tok.expires_at <= timezone.now():
        return (
            f"the enrollment token {tok.prefix}… of this join link expired at "
            f"{tok.expires_at:%Y-%m-%d %H:%M} UTC; {again}"
        )
    if tok.uses >= tok.max_uses:
        return (
            f"the enrollment token {tok.prefix}… of this join link has been used ({tok.uses} of "
            f"{tok.max_uses}); {again}, or upgrade an enrolled node with "
            "`~/.racon-agent/venv/bin/node-agent upgrade`"
        )
    return None


def _authorized(request: HttpRequest) -> str | None:
    """None when the request carries a usable join token or node credential, else why not."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme == "Join" and value:
        return token_problem(token=value.strip())
    if scheme == "Node" and ":" in value:
        node_id, _, credential = value.strip().partition(":")
        try:
            node_authenticate(node_id=node_id, credential=credential)
        except NodeAuthError as exc:
            return str(exc)
        return None
    return "missing 'Authorization: Join <token>' or 'Authorization: Node <id>:<credential>'"


# --- the scripts ---------------------------------------------------------------------------------


def _sh_error(message: str) -> str:
    return f"#!/bin/sh\necho {shlex.quote('racon join: error: ' + message)} >&2\nexit 1\n"


def _py_error(message: str) -> str:
    return f"import sys\nprint({json.dumps('racon join: error: ' + message)}, file=sys.stderr)\nsys.exit(1)\n"


def _script(body: str, *, python: bool) -> HttpResponse:
    # 200 even for an error script: `curl -f | sh` would run an empty script on a 4xx and exit 0.
    kind = "text/x-python" if python else "text/x-shellscript"
    resp = HttpResponse(body, content_type=f"{kind}; charset=utf-8")
    resp["Cache-Control"] = "no-store"
    return resp


def controller_ca_pem() -> str:
    """The CA certificate the join program and the agents check this controller against ("" when
    the controller has none: loopback, or a public certificate behind a proxy)."""
    path = settings.TLS_CA_FILE
    if not path:
        return ""
    try:
        return Path(path).read_text()
    except OSError:
        log.error("RACON_TLS_CA_FILE %s cannot be read; joins get no CA", path)
        return ""


@require_GET
def join_sh(request: HttpRequest, token: str) -> HttpResponse:
    problem = insecure_problem() or token_problem(token=token)
    if problem:
        return _script(_sh_error(problem), python=False)
    url = settings.CONTROLLER_PUBLIC_URL
    pin = settings.TLS_PIN if url.startswith("https://") else ""
    body = (
        (JOIN_DIR / "join.sh")
        .read_text()
        .replace("@@CONTROLLER_URL_SH@@", shlex.quote(url))
        .replace("@@TOKEN_SH@@", shlex.quote(token))
        .replace("@@PIN_SH@@", shlex.quote(pin))
        .replace("@@CONTROLLER_URL@@", url)
    )
    return _script(body, python=False)


@require_GET
def join_py(request: HttpRequest, token: str) -> HttpResponse:
    problem = insecure_problem() or token_problem(token=token)
    if problem:
        return _script(_py_error(problem), python=True)
    body = (
        (JOIN_DIR / "join.py")
        .read_text()
        .replace('"@@CONTROLLER_URL@@"', json.dumps(settings.CONTROLLER_PUBLIC_URL))
        .replace('"@@TOKEN@@"', json.dumps(token))
        .replace('"@@CA_PEM@@"', json.dumps(controller_ca_pem()))
    )
    return _script(body, python=True)


# --- the wheelhouse ------------------------------------------------------------------------------


def _error(message: str, status: int, code: str, **headers: str) -> JsonResponse:
    resp = JsonResponse({"error": {"message": message, "code": code}}, status=status)
    for k, v in headers.items():
        resp[k] = v
    return resp


@cache
def own_platform() -> tuple[str, str]:
    """This controller's platform key and Python ABI: the wheelhouse it can build itself."""
    key = subprocess.run(
        [str(settings.BASE_DIR / "scripts" / "platform-key.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return key, f"cp{sys.version_info.major}{sys.version_info.minor}"


@cache
def agent_source_hash() -> str:
    """The same hash as scripts/build-wheelhouse.py's: a wheelhouse built from older agent code
    is rebuilt. Computed once per process (the running version)."""
    root = settings.BASE_DIR
    h = hashlib.sha256()
    files = sorted((root / "agent").rglob("*.py")) + [root / "packaging/agent/pyproject.toml"]
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def start_build() -> bool:
    """Start scripts/build-wheelhouse.py unless it runs already; True while it runs."""
    with _build_lock:
        proc = _build.get("proc")
        if proc is not None and proc.poll() is None:
            return True
        if (
            proc is not None
            and proc.returncode != 0
            and not getattr(settings, "JOIN_REBUILD", True)
        ):
            return False
        log_path = Path(settings.VAR_DIR) / "build-wheelhouse.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        key, abi = own_platform()
        log.info(
            "building the join wheelhouse for %s / %s (the first join, or agent/ changed; minutes "
            "if llama.cpp must be compiled), log: %s",
            key,
            abi,
            log_path,
        )
        with open(log_path, "ab") as out:
            _build["proc"] = subprocess.Popen(
                [sys.executable, str(BUILDER)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return True


def _stale(manifest: dict[str, Any]) -> bool:
    return (
        getattr(settings, "JOIN_REBUILD", True)
        and manifest.get("agent_source") != agent_source_hash()
    )


def manifest_for(*, platform: str, abi: str, files_url: str) -> JsonResponse:
    if not _KEY_RE.match(platform) or not _ABI_RE.match(abi):
        return _error("platform must be a platform key and abi like cp312", 400, "bad_platform")
    root = wheelhouse_root()
    own = (platform, abi) == own_platform()
    house = _read_manifest(root / platform / abi)
    if house is not None and own and _stale(house):
        house = None
    if house is None and (own or _read_manifest(root / "source") is None):
        if getattr(settings, "JOIN_REBUILD", True) and start_build():
            return _error(
                "the controller is building the agent's wheelhouse; retry shortly",
                503,
                "wheelhouse_building",
                **{"Retry-After": "5"},
            )
        return _error(
            "the controller has no wheelhouse; run scripts/build-wheelhouse.py",
            503,
            "no_wheelhouse",
        )
    if house is not None:
        mode, where, body = "wheels", f"{platform}/{abi}", house
    else:
        source = _read_manifest(root / "source") or {}
        served = [
            {"platform": p.parent.name, "abi": p.name}
            for p in sorted(root.glob("*/*"))
            if p.parent.name not in ("source", "bundles") and (p / "manifest.json").is_file()
        ]
        mode, where, body = "build", "source", {**source, "served": served}
    files = [
        {**f, "url": f"{files_url}/{where}/{f['name']}"}
        for f in body.get("files", [])
        if isinstance(f, dict)
    ]
    return JsonResponse(
        {
            **{k: v for k, v in body.items() if k != "files"},
            "mode": mode,
            "platform": platform,
            "abi": abi,
            "protocol_version": PROTOCOL_VERSION,
            # The standalone agent, for machines without Python (the join line's own route).
            "bundles": bundle_summaries(),
            "controller_url": settings.CONTROLLER_PUBLIC_URL,
            # `node-agent upgrade` re-pins with it (the channel it comes over is already checked).
            "ca_pem": controller_ca_pem(),
            "files": files,
        }
    )


@require_GET
def join_manifest(request: HttpRequest, token: str) -> JsonResponse:
    problem = token_problem(token=token)
    if problem:
        return _error(problem, 410, "join_token_unusable")
    return manifest_for(
        platform=request.GET.get("platform", ""),
        abi=request.GET.get("abi", ""),
        files_url="/join/files",
    )


@require_GET
def upgrade_manifest(request: HttpRequest) -> JsonResponse:
    problem = _authorized(request)
    if problem:
        return _error(problem, 401, "unauthorized")
    return manifest_for(
        platform=request.GET.get("platform", ""),
        abi=request.GET.get("abi", ""),
        files_url="/api/agent/wheelhouse/files",
    )


@require_GET
def wheelhouse_file(request: HttpRequest, rel: str) -> HttpResponse | FileResponse:
    """One file a manifest lists (nothing else under the wheelhouse is reachable)."""
    problem = _authorized(request)
    if problem:
        return _error(problem, 401, "unauthorized")
    parts = rel.split("/")
    if parts[0] == "source":
        directory, name = wheelhouse_root() / "source", "/".join(parts[1:])
    elif len(parts) >= 3:
        directory, name = wheelhouse_root() / parts[0] / parts[1], "/".join(parts[2:])
    else:
        return _error("no such file", 404, "not_found")
    manifest = _read_manifest(directory) if ".." not in parts else None
    listed = {f.get("name") for f in (manifest or {}).get("files", []) if isinstance(f, dict)}
    if name not in listed:
        return _error("no such file", 404, "not_found")
    return FileResponse(open(directory / name, "rb"), content_type="application/octet-stream")
