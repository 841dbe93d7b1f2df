"""`node-agent upgrade`: install the controller's agent and llama.cpp into this agent's venv.

Uses the node's own credential (never an enrollment token): GET
/api/agent/wheelhouse/manifest.json with this venv's platform key (llama.cpp/PLATFORM, written by
the join line) and Python ABI, then each file, checked against its sha256, then `pip install
--no-index` from those files only. The running agent keeps running the old code until restarted.
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
from typing import Any

import httpx

from agent import __version__
from agent.identity import Identity
from agent.protocol import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS


class UpgradeError(Exception):
    """The upgrade cannot go on; the message is one line for the operator."""


def venv_platform() -> str:
    path = Path(sys.prefix) / "llama.cpp" / "PLATFORM"
    try:
        return path.read_text().strip()
    except OSError:
        raise UpgradeError(
            f"{path} is missing: this agent was not installed by the join line; upgrade it the "
            "way it was installed (for a checkout: make install)"
        ) from None


def _check_protocol(manifest: dict[str, Any]) -> None:
    theirs = int(manifest.get("protocol_version", 1))
    if theirs not in SUPPORTED_PROTOCOL_VERSIONS:
        # Still upgrade: the new agent is the one that speaks the controller's protocol.
        print(
            f"node-agent: the controller speaks node protocol {theirs}; this agent "
            f"({__version__}) speaks {PROTOCOL_VERSION}: upgrading to the controller's agent"
        )


def upgrade(identity: Identity, *, timeout: float = 120.0) -> str:
    """Install the controller's wheels; returns the new agent version."""
    key = venv_platform()
    abi = f"cp{sys.version_info.major}{sys.version_info.minor}"
    headers = {"Authorization": f"Node {identity.node_id}:{identity.credential}"}
    with httpx.Client(base_url=identity.controller_url, headers=headers, timeout=timeout) as http:
        resp = http.get("/api/agent/wheelhouse/manifest.json", params={"platform": key, "abi": abi})
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {resp.status_code}"
            raise UpgradeError(f"the controller refused the upgrade: {message}")
        manifest = resp.json()
        if manifest.get("mode") != "wheels":
            raise UpgradeError(
                f"the controller has no wheels for {key} / {abi}; run the join line again to "
                "build llama.cpp on this machine"
            )
        _check_protocol(manifest)
        with tempfile.TemporaryDirectory(prefix="racon-upgrade-") as tmp:
            by_kind: dict[str, list[str]] = {}
            for f in manifest["files"]:
                target = Path(tmp) / f["name"]
                target.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                with http.stream("GET", f["url"]) as r, open(target, "wb") as out:
                    if r.status_code != 200:
                        raise UpgradeError(f"download of {f['name']} failed: HTTP {r.status_code}")
                    for block in r.iter_bytes(1 << 20):
                        h.update(block)
                        out.write(block)
                if h.hexdigest() != f["sha256"]:
                    raise UpgradeError(
                        f"{f['name']}: sha256 mismatch (the controller lists {f['sha256']}, the "
                        f"download is {h.hexdigest()}); nothing was installed"
                    )
                by_kind.setdefault(f["kind"], []).append(str(target))
            own = by_kind["agent"] + by_kind["llama-cpp-python"]
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index"]
            pip += ["--find-links", tmp, "--find-links", str(Path(tmp) / "deps")]
            env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
            for extra in ([], ["--no-deps", "--force-reinstall"]):
                proc = subprocess.run(
                    [*pip, *extra, *own], capture_output=True, text=True, env=env, check=False
                )
                if proc.returncode != 0:
                    raise UpgradeError(f"pip install failed: {proc.stderr[-1500:]}")
            bin_dir = Path(sys.prefix) / "llama.cpp" / "bin"
            with tarfile.open(by_kind["llama-bin"][0]) as tar:
                staged = Path(tmp) / "llama-bin"
                tar.extractall(staged, filter="data")
            for exe in ("llama-server", "ggml-rpc-server"):
                tmp_exe = bin_dir / f".{exe}.new"
                shutil.copy(staged / "bin" / exe, tmp_exe)
                tmp_exe.chmod(0o755)
                tmp_exe.replace(bin_dir / exe)  # a running server keeps its old inode
            shutil.copy(staged / "PLATFORM", Path(sys.prefix) / "llama.cpp" / "PLATFORM")
    return str(manifest.get("agent_version", "?"))
