"""First run: join this machine from the window (issue 31).

The owner pastes the join line (``curl -fsSL[k] [--pinnedpubkey sha256//PIN] URL/join/rcn_… | sh``,
its ``python3 -c`` form, the bare join URL) or the token alone (with ``--controller-url``). The
line is parsed, never run: a shell never sees it. What is taken from it is the controller's
origin, the pin and the token, and the node-agent arguments after ``| sh -s --`` (plain words only).

The join itself is the controller's own join script, the one the line would have run
(GET /join/<token>, packaging/join/join.sh): fetched here over the same pinned channel, checked to
be a script, and given to ``sh -s`` on its standard input with the arguments as argv. So the
install (the standalone bundle, else the Python route), its checks (sha256, architecture, glibc,
disk) and their error texts are the join script's, not a copy. Its ``racon join: …`` lines are the
window's progress; then the node's enrollment (identity.json in the state dir) and its state on
the controller until READY.

Before anything is installed the window shows what will be: the controller's answer for this
machine (GET /join/<token>/bundle.txt, what join.sh asks first). A malformed line or a token the
controller refuses stops there, and nothing is written.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import ipaddress
import os
import platform
import re
import shlex
import ssl
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# apps/nodes/join_urls.py's TOKEN (a test checks they agree).
TOKEN_RE = re.compile(r"rcn_[A-Za-z0-9_-]{1,200}")
PIN_RE = re.compile(r"sha256//[A-Za-z0-9+/]{43}=")
# node-agent arguments after `| sh -s --`: plain words (they are argv, never a shell's input).
ARG_RE = re.compile(r"[A-Za-z0-9_.,:=@+/-]{1,200}")
CURL_FLAGS = {"-f", "-s", "-S", "-L", "-k", "-fsSL", "-fsSLk", "-sSL"}
PROGRESS = "racon join: "


class JoinLineError(ValueError):
    """What is wrong with the pasted line, said to the owner as is."""


@dataclass(frozen=True)
class JoinLine:
    controller: str  # the controller's origin: scheme://host[:port]
    token: str
    pin: str = ""  # sha256//… (a LAN controller's line), "" for none
    args: tuple[str, ...] = ()

    @property
    def script_path(self) -> str:
        return f"/join/{self.token}"

    def describe(self) -> str:
        pin = f", pinned {self.pin[:20]}…" if self.pin else ""
        return f"{self.controller} (token {self.token[:10]}…{pin})"


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _from_url(raw: str, pin: str, args: tuple[str, ...], env: Mapping[str, str]) -> JoinLine:
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JoinLineError(f"{raw!r} is not the controller's http(s) join URL")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise JoinLineError(f"the join URL {raw!r} has parts a join URL never has (user, ?, #)")
    m = re.fullmatch(r"/join/(rcn_[^/]*?)(\.py)?", parts.path)
    if not m:
        raise JoinLineError(f"the URL {raw!r} is not a join URL (…/join/rcn_…)")
    token = m.group(1)
    if not TOKEN_RE.fullmatch(token):
        raise JoinLineError(f"the token in {raw!r} is malformed (rcn_ and letters, digits, _ or -)")
    if pin and parts.scheme != "https":
        raise JoinLineError("the line pins a certificate but its URL is plain http")
    if (
        parts.scheme == "http"
        and not _loopback(parts.hostname)
        and env.get("RACON_INSECURE_LAN") != "1"
    ):
        raise JoinLineError(
            f"the join URL is plain http on a network ({parts.hostname}): the token and the "
            "install would cross an unauthenticated channel; ask for the https line with a pin "
            "(or set RACON_INSECURE_LAN=1 to accept that risk)"
        )
    origin = f"{parts.scheme}://{parts.netloc}"
    return JoinLine(controller=origin, token=token, pin=pin, args=args)


def _sh_args(words: list[str]) -> tuple[str, ...]:
    if not words or words[0] not in ("sh", "/bin/sh", "bash"):
        raise JoinLineError("the line must end with `| sh` (optionally `| sh -s -- ARGS`)")
    rest = words[1:]
    if not rest:
        return ()
    if rest[:2] != ["-s", "--"]:
        raise JoinLineError(f"after `| sh` only `-s -- ARGS` may follow, not {' '.join(rest)!r}")
    bad = [a for a in rest[2:] if not ARG_RE.fullmatch(a)]
    if bad:
        raise JoinLineError(f"the agent's arguments must be plain words, not {bad[0]!r}")
    return tuple(rest[2:])


def parse_join_line(
    text: str, *, controller: str | None = None, env: Mapping[str, str] | None = None
) -> JoinLine:
    """The controller, pin, token and agent arguments of a pasted join line, or of a bare token
    (``controller`` then says where). JoinLineError says what is wrong; nothing is run."""
    env = os.environ if env is None else env
    text = text.strip()
    if not text:
        raise JoinLineError("paste the join line (or the token) the controller's token page gave")
    if "\n" in text or "\r" in text:
        raise JoinLineError("the join line is one line: paste it again without line breaks")
    if TOKEN_RE.fullmatch(text):
        if not controller:
            raise JoinLineError(
                "a token alone does not say which controller it is for: paste the whole line"
            )
        return _from_url(f"{controller.rstrip('/')}/join/{text}", "", (), env)
    if text.startswith("rcn_"):
        raise JoinLineError("the token is malformed: rcn_ and then letters, digits, _ or -")
    if re.match(r"https?://", text) and " " not in text:
        return _from_url(text, "", (), env)
    if text.startswith(("python3 ", "python ")):
        # python3 -c "URL='https://…/join/rcn_….py';PIN='sha256//…';import base64;exec(…)"
        # python3 -c "import urllib.request as u; exec(u.urlopen('http://…/join/rcn_….py').read())"
        url = re.search(r"(?:URL=|urlopen\()'(https?://[^']+)'", text)
        if not url:
            raise JoinLineError("this python3 line has no join URL in it")
        pin = re.search(r"PIN='([^']*)'", text)
        pin_s = pin.group(1) if pin else ""
        if pin_s and not PIN_RE.fullmatch(pin_s):
            raise JoinLineError(
                f"the pin {pin_s!r} is malformed (sha256// and 44 base64 characters)"
            )
        return _from_url(url.group(1), pin_s, (), env)
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
    except ValueError as exc:
        raise JoinLineError(f"the line's quoting is broken ({exc})") from None
    ops = [t for t in tokens if t and all(c in "();<>|&" for c in t)]
    if not ops:
        raise JoinLineError(
            "this is neither a join line (`curl … | sh`), a join URL nor a token (rcn_…)"
        )
    if ops != ["|"]:
        raise JoinLineError("the line holds more than one command: paste the line as given")
    bar = tokens.index("|")
    words, right = tokens[:bar], tokens[bar + 1 :]
    if not words or words[0] != "curl":
        raise JoinLineError("the join line starts with curl (`curl -fsSL URL | sh`)")
    args = _sh_args(right)
    pin, url = "", ""
    i = 1
    while i < len(words):
        w = words[i]
        if w in ("--pinnedpubkey", "-w", "--write-out"):
            if i + 1 >= len(words):
                raise JoinLineError(f"{w} has no value")
            if w == "--pinnedpubkey":
                pin = words[i + 1]
                if not PIN_RE.fullmatch(pin):
                    raise JoinLineError(
                        f"the pin {pin!r} is malformed (sha256// and 44 base64 characters)"
                    )
            i += 2
            continue
        if w.startswith("-"):
            if w not in CURL_FLAGS:
                raise JoinLineError(f"{w!r} is not part of a join line")
        elif url:
            raise JoinLineError("the line has two URLs")
        else:
            url = w
        i += 1
    if not url:
        raise JoinLineError("the line has no join URL")
    return _from_url(url, pin, args, env)


# --- the pinned channel ----------------------------------------------------------------------------


def spki_pin(der: bytes) -> str:
    """curl's --pinnedpubkey form of a DER certificate's key: sha256// + base64(sha256(SPKI))."""
    key = x509.load_der_x509_certificate(der).public_key()
    spki = key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return "sha256//" + base64.b64encode(hashlib.sha256(spki).digest()).decode()


PIN_MISMATCH = "the controller's certificate does not match the pin in this line"


def fetch(line: JoinLine, path: str, timeout: float = 30) -> tuple[int, bytes]:
    """GET the controller's ``path`` as the line would: with its pin (the certificate's key is
    checked before the request is sent), else the system's CAs for https, else plain http."""
    parts = urlsplit(line.controller)
    host, port = parts.hostname or "", parts.port
    try:
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            ctx = ssl.create_default_context()
            if line.pin:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            sconn = http.client.HTTPSConnection(host, port or 443, context=ctx, timeout=timeout)
            sconn.connect()
            if line.pin:
                der = sconn.sock.getpeercert(True) if sconn.sock else None  # type: ignore[union-attr]
                if not der or spki_pin(der) != line.pin:
                    sconn.close()
                    raise JoinLineError(PIN_MISMATCH)
            conn = sconn
        else:
            conn = http.client.HTTPConnection(host, port or 80, timeout=timeout)
        conn.request("GET", path, headers={"User-Agent": "racon-desktop"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        return resp.status, body
    except (OSError, http.client.HTTPException) as exc:
        raise JoinLineError(f"could not reach the controller at {line.controller}: {exc}") from None


def _cpu_flags() -> str:
    try:
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith(("flags", "Features")):
                return ",".join(row.split(":", 1)[1].split())
    except OSError:
        pass
    return ""


def _glibc() -> str:
    name, version = platform.libc_ver()
    return version if name == "glibc" else ""


def _kv(body: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for row in body.decode(errors="replace").splitlines():
        k, eq, v = row.partition("=")
        if eq and k not in out:
            out[k] = v
    return out


def join_home(env: Mapping[str, str]) -> Path:
    return Path(env.get("RACON_JOIN_HOME") or Path(env.get("HOME") or Path.home()) / ".racon-agent")


def preview(line: JoinLine, *, state_dir: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """What the join will install here: the controller's answer to join.sh's first question
    (bundle.txt for this machine), or the error that stops it (a refused token: nothing is
    installed). JoinLineError when the controller cannot be reached or the pin is wrong."""
    query = urlencode(
        {"machine": platform.machine(), "flags": _cpu_flags(), "glibc": _glibc()}, safe=","
    )
    status, body = fetch(line, f"/join/{line.token}/bundle.txt?{query}")
    home = join_home(env)
    out: dict[str, Any] = {
        "controller": line.controller,
        "pinned": bool(line.pin),
        "args": list(line.args),
        "state_dir": str(state_dir),
        "home": str(home),
    }
    kv = _kv(body) if status == 200 else {}
    if status >= 400:
        # A controller older than the bundle (an HTTP error): join.sh takes the Python route.
        out["route"] = "python"
        out["installs"] = [
            f"the RACoN agent in a Python venv at {home}/venv (wheels the controller serves, "
            "sha256-checked; needs Python 3.12+)",
        ]
    elif kv.get("error"):
        code = kv.get("code", "")
        if code == "1" or "token" in kv["error"]:
            raise JoinLineError(kv["error"])
        out["route"] = "python"
        out["note"] = kv["error"]
        out["installs"] = [
            f"the RACoN agent in a Python venv at {home}/venv (the controller's bundle does not "
            "fit this machine, so the join takes this machine's Python 3.12+)",
        ]
    elif kv.get("wait"):
        out["route"] = "bundle"
        out["note"] = kv.get("message", "the controller is building the agent bundle")
        out["installs"] = [
            f"the standalone agent (node-agent with llama-server and ggml-rpc-server) in {home}, "
            "once the controller has built it",
        ]
    else:
        mib = 1 << 20
        size, unpacked = int(kv.get("size") or 0), int(kv.get("unpacked") or 0)
        out["route"] = "bundle"
        out["bundle"] = kv.get("name", "")
        out["installs"] = [
            f"node-agent {kv.get('agent_version', '')} for {kv.get('machine', '')} with "
            f"llama-server and ggml-rpc-server: a {size / mib:.0f} MiB download "
            f"(sha256 {kv.get('sha256', '')[:12]}…), {unpacked / mib:.0f} MiB in "
            f"{home}/bundles, linked as {home}/agent",
        ]
    if line.pin:
        out["installs"].append(f"the controller's CA certificate as {home}/controller-ca.pem")
    out["installs"].append(
        f"the node's identity in {state_dir}; the agent starts now and keeps running after "
        "this app quits (node-agent stop ends it)"
    )
    return out


def fetch_script(line: JoinLine) -> bytes:
    """The controller's join script for this token (what the line pipes into sh)."""
    status, body = fetch(line, line.script_path, timeout=60)
    if status != 200:
        raise JoinLineError(f"the controller answered HTTP {status} for the join script")
    if not body.startswith(b"#!/bin/sh"):
        raise JoinLineError("the controller's answer is not its join script")
    # A refused token is a two-line script that says why (apps/nodes/join.py _sh_error).
    m = re.match(rb"#!/bin/sh\necho '?racon join: error: (.*?)'? >&2\nexit 1\n?$", body, re.S)
    if m:
        raise JoinLineError(m.group(1).decode(errors="replace").replace("'\\''", "'"))
    return body


@dataclass
class Join:
    """One join in progress: the join script under ``sh -s`` (its own session: the agent it
    starts outlives this app), its ``racon join:`` lines, then enrollment and READY."""

    line: JoinLine
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    steps: list[str] = field(default_factory=list)
    error: str = ""
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self, text: str) -> None:
        with self.lock:
            if not self.steps or self.steps[-1] != text:
                self.steps.append(text)

    def fail(self, text: str) -> None:
        with self.lock:
            self.error = text

    def view(self) -> dict[str, Any]:
        with self.lock:
            return {"steps": list(self.steps), "error": self.error, "done": self.done}

    def start(self, env: Mapping[str, str]) -> None:
        script = fetch_script(self.line)
        self.step(f"fetched the join script from {self.line.controller}")
        run_env = dict(env)
        run_env["RACON_STATE_DIR"] = str(self.state_dir)
        run_env.pop("RACON_ENROLLMENT_TOKEN", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["sh", "-s", "--", *self.line.args],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=run_env,
                cwd=str(Path(run_env.get("HOME") or Path.home())),
                start_new_session=True,
            )
        assert self.proc.stdin is not None
        self.proc.stdin.write(script)
        self.proc.stdin.close()

    def follow(self, ready: Any, timeout: float = 1800) -> None:
        """Progress until READY: the script's lines, its exit (an error), the node's identity,
        then ``ready()`` (the node's state on the controller, or None while unknown)."""
        deadline = time.monotonic() + timeout
        pos = 0
        enrolled = False
        while time.monotonic() < deadline:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                chunk = b""
            if chunk:
                cut = chunk.rfind(b"\n") + 1
                pos += cut
                for raw in chunk[:cut].decode(errors="replace").splitlines():
                    if raw.startswith(PROGRESS + "error: "):
                        self.fail(raw[len(PROGRESS + "error: ") :])
                    elif raw.startswith(PROGRESS):
                        self.step(raw[len(PROGRESS) :])
            code = self.proc.poll() if self.proc else None
            if code is not None:
                if not self.error:
                    self.fail(f"the join script stopped (exit {code}); see {self.log_path}")
                return
            if not enrolled and (self.state_dir / "identity.json").is_file():
                enrolled = True
                self.step("enrolled: the node has its identity")
            if enrolled:
                state = ready()
                if state:
                    self.step(f"the controller has the node {state}")
                    if state == "READY":
                        with self.lock:
                            self.done = True
                        return
            time.sleep(0.5)
        self.fail(f"the node was not READY after {timeout:.0f} s; see {self.log_path}")
