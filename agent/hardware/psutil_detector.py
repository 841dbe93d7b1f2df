"""CPU, memory, disk and network through psutil and /proc (Linux first, portable where cheap)."""

from __future__ import annotations

import platform
import socket
from pathlib import Path
from typing import Any

import psutil


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    model: str = ""
    flags: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if not model and key in ("model name", "hardware", "cpu model"):
            model = value.strip()
        elif not flags and key in ("flags", "features"):
            flags = value.split()
        if model and flags:
            break
    return model or platform.processor() or platform.machine(), flags


def detect_cpu() -> dict[str, Any]:
    model, flags = _cpuinfo()
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    # Flags the scheduler cares about first; the full list is kept too.
    return {
        "model": model,
        "arch": platform.machine(),
        "physical_cores": int(physical),
        "logical_cores": int(logical),
        "flags": flags,
    }


def detect_memory() -> dict[str, int]:
    vm = psutil.virtual_memory()
    return {"total": int(vm.total), "available": int(vm.available)}


def detect_swap() -> dict[str, int]:
    sw = psutil.swap_memory()
    return {"total": int(sw.total), "free": int(sw.free)}


def detect_disk(models_dir: Path) -> dict[str, Any]:
    # The dir may not exist yet; measure the nearest existing parent (same filesystem).
    probe = models_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = psutil.disk_usage(str(probe))
    return {"path": str(models_dir), "total": int(usage.total), "free": int(usage.free)}


def detect_network() -> list[dict[str, Any]]:
    stats = psutil.net_if_stats()
    out: list[dict[str, Any]] = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        addresses = [
            a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
        st = stats.get(name)
        out.append(
            {
                "name": name,
                "addresses": addresses,
                "up": bool(st.isup) if st else False,
                "speed_mbps": int(st.speed) if st else 0,
                "mtu": int(st.mtu) if st else 0,
            }
        )
    return out


def cpu_percent() -> float:
    # Non-blocking: the delta since the previous call (the heartbeat interval).
    return float(psutil.cpu_percent(interval=None))


def mem_available() -> int:
    return int(psutil.virtual_memory().available)
