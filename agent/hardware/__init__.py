"""Hardware discovery: pluggable sources that produce protocol.Hardware and live telemetry."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from agent.hardware import benchmark as _bench
from agent.hardware import gpu_benchmark, nvml, psutil_detector
from agent.hardware.devices import DeviceScan, DeviceScanner, LeftOut, gpu_infos
from agent.hardware.fake import ProfileError, load_profile
from agent.protocol import GpuInfo, Hardware

__all__ = [
    "FakeHardware",
    "HardwareSource",
    "HostHardware",
    "ProfileError",
    "fingerprint",
    "hardware_source",
]


def fingerprint(hw: Hardware) -> str:
    """Identifies the machine for benchmark caching: what would change the measured figures."""
    key = {
        "cpu": [hw["cpu"].get("model"), hw["cpu"].get("logical_cores")],
        # Rounded to GiB: available memory moves, installed memory does not.
        "mem_gib": round(hw["memory"].get("total", 0) / 2**30),
        "gpus": sorted((g["name"], g["uuid"], g["vram_total"]) for g in hw["gpus"]),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class HardwareSource(Protocol):
    # How the GPUs' gflops and mem_bandwidth_gbps came about (measured, or why not): doctor.
    gpu_benchmark_detail: str
    # Devices llama.cpp listed that are not lent (nonsense figures): one event each at start.
    devices_left_out: list[LeftOut]

    def device_scan(self) -> DeviceScan: ...

    def inventory(self, *, benchmark: bool = True) -> Hardware: ...

    def telemetry(self) -> dict[str, Any]: ...

    def memory_total(self) -> int: ...


class HostHardware:
    """The real machine: psutil + /proc, GPUs through ggml's device API (agent/hardware/devices.py),
    NVML for NVIDIA's live figures."""

    def __init__(
        self, models_dir: Path, state_dir: Path, scanner: DeviceScanner | None = None
    ) -> None:
        self.models_dir = models_dir
        self.state_dir = state_dir
        self._memory_total: int | None = None
        self.gpu_benchmark_detail = "not run"
        self.scanner = scanner or DeviceScanner()
        self.devices_left_out: list[LeftOut] = []
        self._gpus: list[GpuInfo] = []

    def device_scan(self) -> DeviceScan:
        return self.scanner.scan()

    def inventory(self, *, benchmark: bool = True) -> Hardware:
        scan = self.scanner.scan(fresh=True)
        self.devices_left_out = list(scan.left_out)
        self._gpus = gpu_infos(scan, nvml.detect_gpus())
        hw = Hardware(
            cpu=psutil_detector.detect_cpu(),
            memory=psutil_detector.detect_memory(),
            swap=psutil_detector.detect_swap(),
            disk=psutil_detector.detect_disk(self.models_dir),
            network=psutil_detector.detect_network(),
            gpus=copy.deepcopy(self._gpus),
        )
        self._memory_total = hw["memory"]["total"]
        hw["fingerprint"] = fingerprint(hw)
        from agent.runtime.vllm import enabled_engines  # noqa: PLC0415  (no import cycle at start)

        hw["engines"] = enabled_engines()
        if benchmark:
            hw["benchmark"] = _bench.cached_benchmarks(self.state_dir, hw["fingerprint"])
            gpu = gpu_benchmark.cached_gpu_benchmarks(
                self.state_dir, hw["fingerprint"], hw["gpus"], self.models_dir
            )
            gpu.apply(hw["gpus"])
            self.gpu_benchmark_detail = gpu.detail
        return hw

    def telemetry(self) -> dict[str, Any]:
        return {
            "cpu_percent": psutil_detector.cpu_percent(),
            "mem_available": psutil_detector.mem_available(),
            "gpu_free": self.gpu_free(),
        }

    def gpu_free(self) -> list[int]:
        """Each inventory GPU's free memory: NVML's live figure on NVIDIA (no context needed),
        else the backend's from the cached child scan (at most every SCAN_TTL_S)."""
        if not self._gpus:
            return []
        live = {g["index"]: g["vram_free"] for g in nvml.detect_gpus()}
        by_name: dict[str, int] | None = None
        out = []
        for g in self._gpus:
            if "nvml_index" in g and g["nvml_index"] in live:
                out.append(min(live[g["nvml_index"]], g["vram_total"]))
                continue
            if by_name is None:
                by_name = {str(d["name"]): int(d["memory_free"]) for d in self.scanner.scan().gpus}
            out.append(by_name.get(g.get("device", ""), g["vram_free"]))
        return out

    def memory_total(self) -> int:
        if self._memory_total is None:
            self._memory_total = psutil_detector.detect_memory()["total"]
        return self._memory_total


class FakeHardware:
    """A JSON profile posing as the machine (tests: a GPU box, a big-RAM box)."""

    def __init__(self, profile: Hardware, state_dir: Path | None = None) -> None:
        self.profile = profile
        self.state_dir = state_dir
        self.gpu_benchmark_detail = "a hardware profile: its GPUs' figures, if any, as written"
        self.devices_left_out: list[LeftOut] = []

    def device_scan(self) -> DeviceScan:
        return DeviceScan(
            gpus=[
                {
                    "name": g.get("device", f"GPU{g['index']}"),
                    "description": g["name"],
                    "memory_free": g["vram_free"],
                    "memory_total": g["vram_total"],
                }
                for g in self.profile["gpus"]
            ],
            backends=["a hardware profile"],
        )

    @classmethod
    def from_file(cls, path: Path, state_dir: Path | None = None) -> FakeHardware:
        return cls(load_profile(path), state_dir)

    def inventory(self, *, benchmark: bool = True) -> Hardware:
        hw = copy.deepcopy(self.profile)
        hw["fingerprint"] = fingerprint(hw)
        if benchmark and "benchmark" not in hw and self.state_dir is not None:
            hw["benchmark"] = _bench.cached_benchmarks(self.state_dir, hw["fingerprint"])
        return hw

    def telemetry(self) -> dict[str, Any]:
        return {
            "cpu_percent": 0.0,
            "mem_available": int(self.profile["memory"].get("available", 0)),
            "gpu_free": [g["vram_free"] for g in self.profile["gpus"]],
        }

    def memory_total(self) -> int:
        return int(self.profile["memory"].get("total", 0))


def hardware_source(
    models_dir: Path, state_dir: Path, profile_path: Path | None = None
) -> HardwareSource:
    if profile_path is not None:
        return FakeHardware.from_file(profile_path, state_dir)
    return HostHardware(models_dir, state_dir)
