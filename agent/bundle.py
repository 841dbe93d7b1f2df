"""The standalone bundle the join line installs (issue 26): where it lives, and its upgrade.

The join line unpacks each bundle into ~/.racon-agent/bundles/<id>/ and points the symlink
~/.racon-agent/agent at it; the service runs ~/.racon-agent/agent/node-agent. `node-agent
upgrade` asks the controller for the bundle this machine runs (GET /api/agent/bundle.txt with the
node's credential), checks its sha256 and glibc floor, unpacks it beside the others and switches
the link with one rename: a running agent keeps its files, the next start runs the new one, and
the previous bundle stays for a rollback (older ones are removed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import httpx

from agent.identity import Identity


class BundleError(Exception):
    """The bundle upgrade cannot go on; one line for the operator. Nothing was changed."""


def bundle_home(executable: str | None = None) -> Path | None:
    """~/.racon-agent when this agent runs from a bundle the join line installed, else None."""
    if executable is None:
        if not getattr(sys, "frozen", False):
            return None
        executable = sys.executable
    exe = Path(executable).resolve()
    if exe.parent.parent.name != "bundles":
        return None
    return exe.parent.parent.parent


def stable_executable() -> str:
    """What a service should start: the link the upgrade switches, not this bundle's own path."""
    home = bundle_home()
    if home is not None and (home / "agent" / "node-agent").exists():
        return str(home / "agent" / "node-agent")
    return sys.executable


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return ",".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ""


def glibc_version() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ""


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def parse_lines(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def upgrade_bundle(identity: Identity, home: Path, *, ca_file: Path | None = None) -> str:
    """Install the controller's bundle for this machine and switch the link; returns its
    version ("" when the installed one is already current)."""
    headers = {"Authorization": f"Node {identity.node_id}:{identity.credential}"}
    verify: str | bool = str(ca_file) if ca_file and ca_file.is_file() else True
    with httpx.Client(
        base_url=identity.controller_url, headers=headers, timeout=600, verify=verify
    ) as http:
        resp = http.get(
            "/api/agent/bundle.txt", params={"machine": os.uname().machine, "flags": cpu_flags()}
        )
        if resp.status_code != 200:
            raise BundleError(f"the controller refused the upgrade: HTTP {resp.status_code}")
        answer = parse_lines(resp.text)
        if "error" in answer or "wait" in answer:
            raise BundleError(answer.get("error") or answer.get("message") or "try again shortly")
        if answer.get("machine") != os.uname().machine:
            raise BundleError(
                f"this machine is {os.uname().machine}, the controller's bundle is for "
                f"{answer.get('machine')}"
            )
        mine = glibc_version().split()[-1] if glibc_version() else ""
        if mine and _version_tuple(mine) < _version_tuple(answer.get("glibc", "0")):
            raise BundleError(
                f"this machine's glibc is {mine}, the bundle needs {answer['glibc']} or newer"
            )
        name = answer["name"]
        bid = name.removesuffix(".tar.gz")
        target = home / "bundles" / bid
        if (home / "agent").resolve() == target.resolve() and (target / "node-agent").exists():
            return ""
        with tempfile.TemporaryDirectory(prefix=".upgrade-", dir=home) as tmp:
            archive = Path(tmp) / name
            h = hashlib.sha256()
            with http.stream("GET", answer["url"]) as r, open(archive, "wb") as out:
                if r.status_code != 200:
                    raise BundleError(f"download of {name} failed: HTTP {r.status_code}")
                for block in r.iter_bytes(1 << 20):
                    h.update(block)
                    out.write(block)
            if h.hexdigest() != answer["sha256"]:
                raise BundleError(
                    f"{name}: sha256 mismatch (the controller lists {answer['sha256']}, the "
                    f"download is {h.hexdigest()}); nothing was installed"
                )
            with tarfile.open(archive) as tar:
                tar.extractall(Path(tmp) / "x", filter="tar")
            if not (Path(tmp) / "x" / "node-agent" / "node-agent").is_file():
                raise BundleError(f"{name} holds no node-agent; nothing was installed")
            shutil.rmtree(target, ignore_errors=True)
            (Path(tmp) / "x" / "node-agent").rename(target)
    switch(home, bid)
    return answer.get("agent_version", "?")


def switch(home: Path, bid: str) -> None:
    """Point home/agent at bundles/<bid> with one rename; keep the previous bundle only."""
    link = home / "agent"
    previous = Path(os.readlink(link)).name if link.is_symlink() else None
    new = home / "agent.new"
    new.unlink(missing_ok=True)
    os.symlink(f"bundles/{bid}", new)
    os.replace(new, link)
    for d in (home / "bundles").iterdir():
        if d.name not in (bid, previous):
            shutil.rmtree(d, ignore_errors=True)


def restart_service(unit: str, *, user: bool) -> str:
    """`systemctl [--user] restart UNIT`; returns one line saying what happened."""
    if shutil.which("systemctl") is None:
        return "systemctl not found: restart the agent yourself"
    cmd = ["systemctl", *(["--user"] if user else []), "restart", unit]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        return f"restarting {unit} failed: {proc.stderr.strip()[-300:]}"
    return f"{unit} restarted"
