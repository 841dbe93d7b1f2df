"""GPUs as llama.cpp sees them: ggml's device API (CUDA, Vulkan, Metal, HIP alike).

The list is read in a short-lived child process (agent/runtime/ggml.py's main): initialising a
backend creates a device context (hundreds of MiB of VRAM on CUDA) that the agent must not hold,
and a driver crash then costs the scan, not the agent. The scan is cached for SCAN_TTL_S, so a
heartbeat reads live free memory at most that often; on NVIDIA, NVML's figure is the live one
(no context needed), and NVML keeps what only it gives (utilisation, power, temperature).

What is lent:
- devices of type gpu or igpu, by llama.cpp's names (CUDA0, Vulkan0, ROCm0, Metal);
- a software Vulkan device (Mesa's lavapipe/llvmpipe, a CPU-type device) only when
  GGML_VK_VISIBLE_DEVICES names devices explicitly, as the tests do: otherwise a desktop with Mesa
  would lend its CPU twice (ggml itself skips CPU-type Vulkan devices unless that variable is set);
- never a device whose figures are nonsense (no memory, free above total): it is left out, and
  the agent reports one event naming it (LeftOut).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.protocol import GpuInfo

log = logging.getLogger("agent.hardware.devices")

SCAN_TIMEOUT_S = 120.0  # Mesa compiles nothing at a scan, but a cold driver can take seconds
SCAN_TTL_S = 60.0
SOFTWARE_VULKAN = ("llvmpipe", "lavapipe", "swiftshader")
# Each backend's own variable that selects its devices (what the primary's environment inherits).
VISIBLE_VARIABLES = {
    "CUDA": "CUDA_VISIBLE_DEVICES",
    "ROCm": "HIP_VISIBLE_DEVICES",
    "Vulkan": "GGML_VK_VISIBLE_DEVICES",
}
_CHILD = "import sys; from agent.runtime.ggml import main; sys.exit(main())"


@dataclass(frozen=True)
class LeftOut:
    name: str
    description: str
    reason: str


@dataclass
class DeviceScan:
    """What one scan found: the devices to lend, those left out and why, and the backends."""

    gpus: list[dict[str, Any]] = field(default_factory=list)  # ggml DeviceInfo dicts, lent
    left_out: list[LeftOut] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    error: str = ""


def run_child() -> dict[str, Any]:
    """ggml's device list from a child process (its own backend contexts die with it)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=SCAN_TIMEOUT_S,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"device scan exited {proc.returncode}: {proc.stderr[-300:]}"}
    data: dict[str, Any] = json.loads(lines[-1])
    return data


def is_software_vulkan(dev: dict[str, Any]) -> bool:
    desc = str(dev.get("description", "")).lower()
    return str(dev.get("backend", "")) == "Vulkan" and any(s in desc for s in SOFTWARE_VULKAN)


def classify(raw: dict[str, Any], *, environ: dict[str, str] | None = None) -> DeviceScan:
    """Split a device list into what is lent and what is left out (pure: tests feed it lists)."""
    env = os.environ if environ is None else environ
    scan = DeviceScan(error=str(raw.get("error") or ""))
    for dev in raw.get("devices") or []:
        backend = str(dev.get("backend") or "")
        if backend and backend not in scan.backends:
            scan.backends.append(backend)
        name = str(dev.get("name", ""))
        if dev.get("type") not in ("gpu", "igpu") or backend == "RPC" or name.startswith("RPC"):
            continue
        if is_software_vulkan(dev) and not env.get("GGML_VK_VISIBLE_DEVICES"):
            # The machine's CPU in Vulkan's clothes: lent already as the CPU.
            continue
        total, free = int(dev.get("memory_total") or 0), int(dev.get("memory_free") or 0)
        reason = ""
        if total <= 0:
            reason = f"reports no memory (total {total})"
        elif free < 0 or free > total:
            reason = f"reports {free} bytes free of {total} total"
        if reason:
            scan.left_out.append(LeftOut(name, str(dev.get("description", "")), reason))
            continue
        scan.gpus.append(dev)
    return scan


_VENDORS = (
    ("nvidia", "nvidia"),
    ("geforce", "nvidia"),
    ("radeon", "amd"),
    ("amd", "amd"),
    ("intel", "intel"),
    ("apple", "apple"),
    ("llvmpipe", "mesa"),
    ("lavapipe", "mesa"),
)
_BACKEND_VENDOR = {"CUDA": "nvidia", "ROCm": "amd", "Metal": "apple"}


def vendor_of(dev: dict[str, Any]) -> str:
    known = _BACKEND_VENDOR.get(str(dev.get("backend", "")))
    if known:
        return known
    desc = str(dev.get("description", "")).lower()
    return next((v for word, v in _VENDORS if word in desc), "unknown")


def gpu_infos(scan: DeviceScan, nvml: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The inventory's GPUs: ggml's devices, each matched to its NVML entry where there is one
    (same PCI bus id, else the same name in order) for the uuid, the driver and the live free
    figure; names follow llama.cpp (``device``)."""
    used: set[int] = set()

    def nvml_match(dev: dict[str, Any]) -> GpuInfo | None:
        if vendor_of(dev) != "nvidia":
            return None
        bus = str(dev.get("device_id") or "").lower()
        for i, g in enumerate(nvml):
            if i not in used and bus and bus.endswith(str(g.get("pci_bus_id", "")).lower()[-12:]):
                used.add(i)
                return g
        for i, g in enumerate(nvml):
            if i not in used and str(g["name"]).strip() == str(dev.get("description", "")).strip():
                used.add(i)
                return g
        return None

    out: list[GpuInfo] = []
    for pos, dev in enumerate(scan.gpus):
        nv = nvml_match(dev)
        total = int(dev["memory_total"])
        free = int(dev["memory_free"])
        if nv is not None:
            # NVML's free figure is live and needs no context; the backend's was read in a child.
            free = min(int(nv["vram_free"]), total)
        info = GpuInfo(
            index=pos,
            vendor=vendor_of(dev),
            name=str(dev.get("description") or dev.get("name")),
            uuid=str(nv["uuid"]) if nv else str(dev.get("device_id") or f"{dev['name']}"),
            vram_total=total,
            vram_free=free,
            driver=str(nv["driver"]) if nv else "",
        )
        info["device"] = str(dev["name"])
        info["backend"] = str(dev.get("backend") or "")
        if is_software_vulkan(dev):
            info["software"] = True
        if nv is not None:
            info["nvml_index"] = int(nv["index"])
        out.append(info)
    return out


class DeviceScanner:
    """The cached child-process scan (one per agent)."""

    def __init__(
        self,
        runner: Callable[[], dict[str, Any]] = run_child,
        ttl: float = SCAN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._at: float | None = None
        self._scan = DeviceScan()

    def scan(self, *, fresh: bool = False) -> DeviceScan:
        with self._lock:
            now = self.clock()
            if fresh or self._at is None or now - self._at >= self.ttl:
                try:
                    raw = self.runner()
                except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
                    raw = {"error": f"device scan failed: {exc}"}
                self._scan = classify(raw)
                self._at = now
                if self._scan.error:
                    log.info("llama.cpp device scan: %s", self._scan.error)
            return self._scan


def describe(scan: DeviceScan) -> list[str]:
    """`node-agent doctor`'s lines: the backends, then each lent device with its memory."""
    lines = [f"backends: {', '.join(scan.backends) or 'none found'}"]
    if scan.error:
        lines.append(f"device scan: {scan.error}")
    for dev in scan.gpus:
        lines.append(
            f"{dev['name']}: {dev.get('description', '')} ({int(dev['memory_total']) >> 20} MiB, "
            f"{int(dev['memory_free']) >> 20} MiB free)"
        )
    for left in scan.left_out:
        lines.append(f"{left.name}: {left.description}: left out, {left.reason}")
    return lines
