"""`node-agent install-service` / `uninstall-service`: a systemd unit that runs the agent.

The unit runs ``node-agent --foreground <flags>`` (systemd keeps it attached; SIGTERM drains it,
within --drain-seconds, before systemd's TimeoutStopSec). ``--user`` writes a user unit in
``~/.config/systemd/user`` instead of ``/etc/systemd/system``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from agent.bundle import stable_executable

UNIT_NAME = "racon-agent.service"


def unit_path(*, user: bool, home: Path | None = None) -> Path:
    if user:
        base = os.environ.get("XDG_CONFIG_HOME") or str((home or Path.home()) / ".config")
        return Path(base) / "systemd" / "user" / UNIT_NAME
    return Path("/etc/systemd/system") / UNIT_NAME


def unit_text(
    *, flags: Sequence[str], user: bool, python: str | None = None, drain_seconds: float = 10.0
) -> str:
    """The unit file's content: ExecStart runs the agent in the foreground with ``flags``."""
    run = ["--foreground", *[f for f in flags if f != "--foreground"]]
    if python is None and getattr(sys, "frozen", False):
        # The standalone bundle: the link `node-agent upgrade` switches, not this bundle's path.
        argv = [stable_executable(), *run]
    else:
        argv = [python or sys.executable, "-m", "agent.cli", *run]
    exec_start = " ".join(shlex.quote(a) for a in argv).replace("%", "%%")
    wanted = "default.target" if user else "multi-user.target"
    return (
        "[Unit]\n"
        "Description=RACoN node agent (lends this machine's compute)\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={exec_start}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        # Exit 2 is a bad configuration (agent/state.py): restarting cannot fix it.
        "RestartPreventExitStatus=2 3\n"
        "KillSignal=SIGTERM\n"
        f"TimeoutStopSec={int(drain_seconds) + 30}\n"
        "\n"
        "[Install]\n"
        f"WantedBy={wanted}\n"
    )


def _systemctl(user: bool, *args: str) -> subprocess.CompletedProcess[str] | None:
    if shutil.which("systemctl") is None:
        return None
    cmd = ["systemctl", *(["--user"] if user else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def verify_unit(path: Path) -> tuple[bool | None, str]:
    """``systemd-analyze verify`` when present: (ok, output); (None, why) when absent."""
    if shutil.which("systemd-analyze") is None:
        return None, "systemd-analyze not found"
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def install_service(
    *, flags: Sequence[str], user: bool, enable: bool = True, drain_seconds: float = 10.0
) -> tuple[Path, str]:
    """Write the unit and enable it (``systemctl [--user] enable --now``). Returns (path, note)."""
    path = unit_path(user=user)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text(flags=flags, user=user, drain_seconds=drain_seconds))
    if not enable:
        return path, "written (not enabled)"
    if _systemctl(user, "daemon-reload") is None:
        return path, "written; systemctl not found, so it is not enabled"
    proc = _systemctl(user, "enable", "--now", UNIT_NAME)
    if proc is None or proc.returncode != 0:
        return path, f"written; enabling failed: {(proc.stderr if proc else '').strip()}"
    return path, "written and enabled"


def uninstall_service(*, user: bool) -> tuple[Path, bool]:
    """Disable and stop the unit, then remove it. Returns (path, whether a file was removed)."""
    path = unit_path(user=user)
    _systemctl(user, "disable", "--now", UNIT_NAME)
    existed = path.exists()
    if existed:
        path.unlink()
    _systemctl(user, "daemon-reload")
    return path, existed
