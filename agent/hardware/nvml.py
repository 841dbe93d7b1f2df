"""NVIDIA GPUs through NVML (the `pynvml` module of nvidia-ml-py). No driver → no GPUs, no error."""

from __future__ import annotations

import logging
import threading
from typing import Any

from agent.protocol import GpuInfo

log = logging.getLogger("agent.hardware.nvml")
_lock = threading.Lock()
_initialised: bool | None = None  # None: not tried; False: no driver, do not retry each beat


def _nvml() -> Any | None:
    global _initialised
    with _lock:
        if _initialised is False:
            return None
        try:
            # nvidia-ml-py may be missing from a slim install: such a machine just has no GPUs.
            import pynvml  # noqa: PLC0415
        except ImportError:
            _initialised = False
            return None
        if _initialised is None:
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                log.info("no NVIDIA GPU detected (%s)", exc)
                _initialised = False
                return None
            _initialised = True
        return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def detect_gpus() -> list[GpuInfo]:
    nv = _nvml()
    if nv is None:
        return []
    gpus: list[GpuInfo] = []
    try:
        driver = _text(nv.nvmlSystemGetDriverVersion())
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            info = GpuInfo(
                index=i,
                vendor="nvidia",
                name=_text(nv.nvmlDeviceGetName(h)),
                uuid=_text(nv.nvmlDeviceGetUUID(h)),
                vram_total=int(mem.total),
                vram_free=int(mem.free),
                driver=driver,
            )
            try:
                info["pci_bus_id"] = _text(nv.nvmlDeviceGetPciInfo(h).busId).lower()
            except Exception:  # an older driver: matched by name instead
                pass
            gpus.append(info)
    except Exception as exc:
        log.warning("NVML query failed: %s", exc)
        return []
    return gpus


def gpu_free() -> list[int]:
    return [g["vram_free"] for g in detect_gpus()]


def gpu_stats() -> list[dict[str, float]]:
    """What only NVML gives: utilisation (%), power (W) and temperature (C) per NVML index."""
    nv = _nvml()
    if nv is None:
        return []
    out: list[dict[str, float]] = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            row: dict[str, float] = {"index": float(i)}
            try:
                row["util_percent"] = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                row["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                row["temperature_c"] = float(nv.nvmlDeviceGetTemperature(h, 0))
            except Exception:  # a field this card does not report
                pass
            out.append(row)
    except Exception as exc:
        log.warning("NVML query failed: %s", exc)
    return out
