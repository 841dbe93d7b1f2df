"""GPUs as llama.cpp sees them (issue 25): what the agent lends from ggml's device list, and the
primary's --device list. The last test reads the real list on Mesa's lavapipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.hardware.devices import DeviceScanner, classify, describe, gpu_infos, run_child
from agent.protocol import GpuInfo
from agent.runtime.server import plan_device_names, server_args
from tests.support.lavapipe import LVP_ICD, require_lavapipe

MiB = 1 << 20


def dev(
    name: str, desc: str, backend: str, free: int, total: int, typ: str = "gpu"
) -> dict[str, Any]:
    return {
        "name": name,
        "description": desc,
        "backend": backend,
        "type": typ,
        "memory_free": free,
        "memory_total": total,
        "device_id": "",
    }


RAW = {
    "devices": [
        dev("CPU", "AMD EPYC", "CPU", 0, 0, "cpu"),
        dev("CUDA0", "NVIDIA H200", "CUDA", 100_000 * MiB, 140_000 * MiB),
        dev("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "Vulkan", 2048 * MiB, 2048 * MiB),
        dev("Vulkan1", "Broken GPU", "Vulkan", 9 * MiB, 4 * MiB),
        dev("Vulkan2", "Empty GPU", "Vulkan", 0, 0),
        dev("RPC0", "10.0.0.2:50052", "RPC", 1 << 30, 1 << 30),
    ]
}


def test_gpus_are_lent_by_llama_cpp_name_and_nonsense_is_left_out_with_the_reason() -> None:
    scan = classify(RAW, environ={})
    assert [d["name"] for d in scan.gpus] == ["CUDA0"]  # no CPU, no RPC, no lavapipe by itself
    assert {(x.name, x.reason) for x in scan.left_out} == {
        ("Vulkan1", f"reports {9 * MiB} bytes free of {4 * MiB} total"),
        ("Vulkan2", "reports no memory (total 0)"),
    }
    assert scan.backends == ["CPU", "CUDA", "Vulkan", "RPC"]


def test_a_software_vulkan_device_is_lent_only_when_ggml_vk_visible_devices_names_it() -> None:
    scan = classify(RAW, environ={"GGML_VK_VISIBLE_DEVICES": "0"})
    assert [d["name"] for d in scan.gpus] == ["CUDA0", "Vulkan0"]
    infos = gpu_infos(scan, [])
    assert infos[1]["device"] == "Vulkan0" and infos[1].get("software") is True
    assert infos[1]["vendor"] == "mesa" and infos[1]["vram_total"] == 2048 * MiB


def test_nvml_gives_the_cuda_device_its_uuid_driver_and_live_free_memory() -> None:
    nvml = [
        GpuInfo(
            index=0,
            vendor="nvidia",
            name="NVIDIA H200",
            uuid="GPU-1234",
            vram_total=140_000 * MiB,
            vram_free=90_000 * MiB,
            driver="580.1",
        )
    ]
    (info,) = gpu_infos(classify(RAW, environ={}), nvml)
    assert (info["device"], info["backend"], info["uuid"], info["driver"]) == (
        "CUDA0",
        "CUDA",
        "GPU-1234",
        "580.1",
    )
    assert info["vram_free"] == 90_000 * MiB and info["nvml_index"] == 0


def test_the_scan_runs_once_per_ttl_and_a_failed_one_says_why() -> None:
    calls: list[int] = []
    now = [0.0]

    def runner() -> dict[str, Any]:
        calls.append(1)
        return RAW

    scanner = DeviceScanner(runner=runner, ttl=60, clock=lambda: now[0])
    scanner.scan()
    now[0] = 30.0
    scanner.scan()
    assert len(calls) == 1
    now[0] = 61.0
    scanner.scan()
    assert len(calls) == 2

    def broken() -> dict[str, Any]:
        raise OSError("no such file")

    scan = DeviceScanner(runner=broken).scan()
    assert scan.gpus == [] and "no such file" in scan.error
    assert any("device scan" in line for line in describe(scan))


def test_llama_server_gets_exactly_the_plans_devices() -> None:
    plan: Any = {
        "deployment_id": "d",
        "rpc_endpoints": ["10.0.0.2:50052"],
        "tensor_split": [10.0, 21.0],
        "n_gpu_layers": 31,
        "offload_devices": ["RPC1", "Vulkan0"],
    }
    args = server_args(plan, Path("/m.gguf"), 8080)
    assert args[args.index("--device") + 1] == "RPC1,Vulkan0"
    assert args.index("--rpc") < args.index("--device")  # --rpc names the RPC devices first
    cpu_only: Any = {**plan, "rpc_endpoints": [], "tensor_split": [], "offload_devices": []}
    args = server_args(cpu_only, Path("/m.gguf"), 8080)
    assert args[args.index("--device") + 1] == "none"
    older: Any = {k: v for k, v in plan.items() if k != "offload_devices"}
    assert plan_device_names(older) is None and "--device" not in server_args(older, Path("/m"), 1)


def test_ggml_lists_lavapipe_as_vulkan0_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    require_lavapipe()
    monkeypatch.setenv("VK_ICD_FILENAMES", str(LVP_ICD))
    monkeypatch.delenv("GGML_VK_VISIBLE_DEVICES", raising=False)
    plain = run_child()
    assert "error" not in plain, plain
    assert not [d for d in plain["devices"] if d["backend"] == "Vulkan"]  # a CPU-type device
    assert {d["backend"] for d in plain["devices"]} == {"CPU"}  # RPC lists no device of its own
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    named = classify(run_child())
    (vk,) = named.gpus
    assert (vk["name"], vk["backend"], vk["type"]) == ("Vulkan0", "Vulkan", "gpu")
    assert vk["memory_total"] == 2048 * MiB and vk["memory_free"] <= vk["memory_total"]
    assert "llvmpipe" in vk["description"]
