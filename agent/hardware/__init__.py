"""Hardware discovery: pluggable sources that produce protocol.Hardware and live telemetry."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from agent.hardware import benchmark as _bench
from agent.hardware import gpu_benchmark, nvml, psutil_detector
from agent.hardware.fake import ProfileError, load_profile
from agent.protocol import Hardware

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

    def inventory(self, *, benchmark: bool = True) -> Hardware: ...

    def telemetry(self) -> dict[str, Any]: ...

    def memory_total(self) -> int: ...


class HostHardware:
    """The real machine: psutil + /proc + NVML."""

    def __init__(self, models_dir: Path, state_dir: Path) -> None:
        self.models_dir = models_dir
        self.state_dir = state_dir
        self._memory_total: int | None = None
        self.gpu_benchmark_detail = "not run"

    def inventory(self, *, benchmark: bool = True) -> Hardware:
        hw = Hardware(
            cpu=psutil_detector.detect_cpu(),
            memory=psutil_detector.detect_memory(),
            swap=psutil_detector.detect_swap(),
            disk=psutil_detector.detect_disk(self.models_dir),
            network=psutil_detector.detect_network(),
            gpus=nvml.detect_gpus(),
        )
        self._memory_total = hw["memory"]["total"]
        hw["fingerprint"] = fingerprint(hw)
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
            "gpu_free": nvml.gpu_free(),
        }

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
