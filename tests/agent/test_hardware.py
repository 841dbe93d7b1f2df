from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from agent.hardware import (
    FakeHardware,
    HostHardware,
    ProfileError,
    fingerprint,
    hardware_source,
    nvml,
)
from agent.hardware import benchmark as bench
from tests.agent.harness import fake_profile


def test_gpu_box_profile_poses_as_a_gpu_machine(tmp_path: Path) -> None:
    profile = fake_profile(
        tmp_path,
        gpus=[
            {
                "name": "RTX 4090",
                "vram_total": 24 * 2**30,
                "vram_free": 20 * 2**30,
                "driver": "550.1",
            }
        ],
    )
    src = hardware_source(tmp_path / "models", tmp_path, profile)
    assert isinstance(src, FakeHardware)
    hw = src.inventory()
    assert hw["gpus"][0]["name"] == "RTX 4090"
    assert hw["gpus"][0]["vram_total"] == 24 * 2**30
    assert hw["gpus"][0]["vendor"] == "nvidia"
    assert hw["benchmark"] == {"gflops": 100.0, "mem_bandwidth_gbps": 20.0}
    assert src.telemetry()["gpu_free"] == [20 * 2**30]
    assert src.memory_total() == 32 * 2**30


def test_big_ram_profile_fills_missing_sections_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "bigram.json"
    path.write_text(json.dumps({"memory": {"total": 512 * 2**30, "available": 500 * 2**30}}))
    hw = FakeHardware.from_file(path).inventory(benchmark=False)
    assert hw["memory"]["total"] == 512 * 2**30
    assert hw["gpus"] == []
    assert hw["cpu"]["logical_cores"] > 0
    assert set(hw) >= {"cpu", "memory", "swap", "disk", "network", "gpus", "fingerprint"}


@pytest.mark.parametrize(
    "content",
    [
        "[1, 2]",
        "{bad json",
        json.dumps({"ram": {}}),
        json.dumps({"gpus": [{"name": "x"}]}),
        json.dumps({"memory": {"total": -1}}),
    ],
)
def test_invalid_profiles_are_refused_with_a_message(tmp_path: Path, content: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match="hardware profile"):
        FakeHardware.from_file(path)


def test_host_detection_reports_real_cpu_memory_disk_and_network(tmp_path: Path) -> None:
    hw = HostHardware(tmp_path / "models-not-yet-created", tmp_path).inventory(benchmark=False)
    assert hw["cpu"]["logical_cores"] >= 1
    assert hw["cpu"]["physical_cores"] >= 1
    assert hw["cpu"]["model"]
    assert hw["memory"]["total"] > hw["memory"]["available"] > 0
    assert hw["disk"]["free"] > 0 and hw["disk"]["path"].endswith("models-not-yet-created")
    names = {n["name"] for n in hw["network"]}
    assert "lo" in names
    lo = next(n for n in hw["network"] if n["name"] == "lo")
    assert "127.0.0.1" in lo["addresses"]


def test_nvml_without_a_driver_degrades_to_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(nvml, "_initialised", None)
    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    assert nvml.detect_gpus() == []
    assert nvml.gpu_free() == []


def test_benchmarks_are_cached_by_fingerprint(tmp_path: Path) -> None:
    calls: list[int] = []

    def runner() -> dict[str, float]:
        calls.append(1)
        return {"gflops": 12.5, "mem_bandwidth_gbps": 3.25}

    a = bench.cached_benchmarks(tmp_path, "fp-a", runner=runner)
    again = bench.cached_benchmarks(tmp_path, "fp-a", runner=runner)
    assert a == again == {"gflops": 12.5, "mem_bandwidth_gbps": 3.25}
    assert len(calls) == 1
    bench.cached_benchmarks(tmp_path, "fp-b", runner=runner)  # other hardware → measure again
    assert len(calls) == 2


def test_a_cached_figure_of_the_old_every_core_method_is_measured_again(tmp_path: Path) -> None:
    # Written by an agent before METHOD 2: the compute figure timed every core at once.
    (tmp_path / bench.CACHE_FILE).write_text(
        json.dumps({"fp-a": {"gflops": 16.9, "mem_bandwidth_gbps": 3.0, "measured_at": 1.0}})
    )
    got = bench.cached_benchmarks(
        tmp_path, "fp-a", runner=lambda: {"gflops": 190.0, "mem_bandwidth_gbps": 3.0}
    )
    assert got["gflops"] == 190.0
    stored = json.loads((tmp_path / bench.CACHE_FILE).read_text())["fp-a"]
    assert stored["method"] == bench.METHOD and stored["gflops"] == 190.0


def test_real_benchmarks_measure_positive_figures() -> None:
    gflops = bench.measure_gflops(budget_s=0.1)
    # One BLAS thread, in a child process: what the claim is made of (times the cores).
    assert bench.measure_thread_gflops(budget_s=0.1) > 0
    gbps = bench.measure_mem_bandwidth(budget_s=0.1, size_mb=16)
    assert gflops > 0
    assert gbps > 0


def test_fingerprint_changes_with_gpus_but_not_with_free_memory(tmp_path: Path) -> None:
    base = FakeHardware.from_file(fake_profile(tmp_path)).inventory(benchmark=False)
    moved = json.loads(json.dumps(base))
    moved["memory"]["available"] //= 2
    assert fingerprint(moved) == fingerprint(base)
    gpu = json.loads(json.dumps(base))
    gpu["gpus"] = [{"name": "A100", "uuid": "GPU-1", "vram_total": 80 * 2**30}]
    assert fingerprint(gpu) != fingerprint(base)
