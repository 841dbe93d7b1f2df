"""The GPU benchmark (agent/hardware/gpu_benchmark.py): its conversions, its choices, and what a
machine without a GPU backend says. No GPU here: the measurement itself runs once on the CPU
build (the same code with nothing to offload to), which checks its mechanics, not a GPU figure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.hardware import HostHardware, gpu_benchmark
from agent.hardware.fake import load_profile
from agent.hardware.gpu_benchmark import (
    ASSUMPTION,
    GpuBackend,
    GpuBenchmarks,
    bandwidth_from_decode,
    cached_gpu_benchmarks,
    device_order,
    doctor_check,
    gflops_from_prompt,
    gpu_backend,
    gpu_benchmarks,
    pick_model,
    run_subprocess,
)
from agent.protocol import GpuInfo
from tests.agent.harness import fake_profile
from tests.smollm2 import smollm2_path


def gpu(index: int, name: str = "NVIDIA Test 80GB") -> GpuInfo:
    return GpuInfo(
        index=index,
        vendor="nvidia",
        name=name,
        uuid=f"GPU-test-{index}",
        vram_total=80 * 2**30,
        vram_free=79 * 2**30,
        driver="test",
    )


def test_prompt_rate_converts_to_gflops_at_two_flops_per_parameter_per_token() -> None:
    # 1 B parameters, 512 tokens in 0.5 s: 2 * 1e9 * 1024 tokens/s = 2048 GFLOPS.
    assert gflops_from_prompt(n_params=10**9, tokens=512, seconds=0.5) == 2048.0
    # SmolLM2-135M at 35 tokens/s (this CPU): about 9.4 GFLOPS.
    assert gflops_from_prompt(n_params=134_515_008, tokens=512, seconds=512 / 34.9) == 9.39


def test_decode_rate_converts_to_bandwidth_at_one_read_of_the_weights_per_token() -> None:
    # A 4 GB model decoding 32 tokens in 0.25 s reads 4 GB 128 times a second.
    assert bandwidth_from_decode(model_bytes=4 * 10**9, tokens=32, seconds=0.25) == 512.0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"n_params": 0, "tokens": 512, "seconds": 1.0}, "n_params"),
        ({"n_params": 10**9, "tokens": 512, "seconds": 0.0}, "seconds"),
    ],
)
def test_a_conversion_refuses_what_cannot_be_a_measurement(
    kwargs: dict[str, float], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        gflops_from_prompt(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_bytes"):
        bandwidth_from_decode(model_bytes=-1, tokens=32, seconds=1.0)


def _llama_cpp_or_skip() -> GpuBackend:
    pytest.importorskip("llama_cpp")
    found = gpu_backend()
    if found.available:
        pytest.skip(f"this machine's llama.cpp has a GPU backend ({found.detail})")
    return found


def test_a_cpu_only_build_says_it_has_no_gpu_backend() -> None:
    """llama_supports_gpu_offload() is true on the RPC build without any GPU: the devices are
    what tells, and the reason names the fix."""
    import llama_cpp  # optional: skipped above when missing

    found = _llama_cpp_or_skip()
    assert llama_cpp.llama_supports_gpu_offload()  # why the device list is checked too
    assert not found.available and found.devices == ()
    assert "no GPU backend in this llama.cpp build" in found.detail
    assert "CPU" in found.detail and "GGML_CUDA" in found.detail


def test_without_a_gpu_backend_every_gpu_falls_back_to_the_assumption(tmp_path: Path) -> None:
    """A GPU that NVML reports (here from a profile) on a CPU-only build: nothing measured,
    nothing put on the inventory, and the reason says what the controller assumes instead."""
    _llama_cpp_or_skip()
    profile = load_profile(fake_profile(tmp_path, gpus=[{"vram_total": 24 * 2**30}]))
    models = tmp_path / "models"
    models.mkdir()
    (models / "small.gguf").symlink_to(smollm2_path())
    got = gpu_benchmarks(profile["gpus"], models)
    assert got.measured == [None]
    assert "no GPU backend" in got.detail and ASSUMPTION in got.detail
    got.apply(profile["gpus"])
    assert "gflops" not in profile["gpus"][0]
    ok, detail = doctor_check(profile["gpus"], got.detail)
    assert ok is None and "no GPU backend" in detail and ASSUMPTION in detail


def test_this_machine_reports_no_gpu_figures_and_doctor_says_why(tmp_path: Path) -> None:
    _llama_cpp_or_skip()
    src = HostHardware(tmp_path / "models", tmp_path / "state")
    hw = src.inventory()
    if hw["gpus"]:
        pytest.skip("NVML reports a GPU here")
    assert src.gpu_benchmark_detail == "no GPU reported by NVML"
    assert not (tmp_path / "state" / gpu_benchmark.CACHE_FILE).exists()
    ok, detail = doctor_check(hw["gpus"], src.gpu_benchmark_detail)
    assert ok is None
    assert "no GPU backend in this llama.cpp build" in detail and ASSUMPTION in detail


def test_a_backend_without_a_model_yet_says_so(tmp_path: Path) -> None:
    backend = GpuBackend(True, ("NVIDIA Test 80GB",), "llama.cpp GPU backend: NVIDIA Test 80GB")
    got = gpu_benchmarks([gpu(0)], tmp_path / "empty", backend=lambda: backend)
    assert got.measured == [None]
    assert "no GGUF" in got.detail and ASSUMPTION in got.detail


def test_the_smallest_plain_gguf_is_timed(tmp_path: Path) -> None:
    (tmp_path / "big.gguf").write_bytes(b"x" * 300)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "small.gguf").write_bytes(b"x" * 200)
    (tmp_path / "mmproj-small.gguf").write_bytes(b"x" * 10)  # a projector, not a model
    (tmp_path / "m-00001-of-00002.gguf").write_bytes(b"x" * 20)  # one part of a split model
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert pick_model(tmp_path) == tmp_path / "sub" / "small.gguf"
    assert pick_model(tmp_path / "missing") is None


def test_each_nvml_gpu_finds_its_llama_cpp_device_by_name_then_position() -> None:
    gpus = [gpu(0, "NVIDIA A"), gpu(1, "NVIDIA B"), gpu(2, "NVIDIA B")]
    # CUDA lists the fastest first: B, B, A.
    assert device_order(gpus, ["NVIDIA B", "NVIDIA B", "NVIDIA A"]) == [2, 0, 1]
    assert device_order(gpus, ["Vulkan0", "Vulkan1", "Vulkan2"]) == [0, 1, 2]
    assert device_order(gpus, ["NVIDIA A"]) == [0, None, None]


def test_only_a_full_measurement_is_cached(tmp_path: Path) -> None:
    gpus = [gpu(0), gpu(1)]
    runs: list[int] = []

    def partial(gs: object, models: Path) -> GpuBenchmarks:
        runs.append(1)
        return GpuBenchmarks([{"gflops": 1.0, "mem_bandwidth_gbps": 2.0}, None], "half")

    def full(gs: object, models: Path) -> GpuBenchmarks:
        runs.append(2)
        fig = {"gflops": 50_000.0, "mem_bandwidth_gbps": 3000.0, "model": "m.gguf"}
        return GpuBenchmarks([fig, dict(fig)], "measured with m.gguf")

    state = tmp_path / "state"
    assert cached_gpu_benchmarks(state, "fp", gpus, tmp_path, measure_gpus=partial).detail == "half"
    assert not (state / gpu_benchmark.CACHE_FILE).exists()
    cached_gpu_benchmarks(state, "fp", gpus, tmp_path, measure_gpus=full)
    again = cached_gpu_benchmarks(state, "fp", gpus, tmp_path, measure_gpus=partial)
    assert runs == [1, 2]
    assert again.detail == "measured with m.gguf (cached)"
    again.apply(gpus)
    assert [(g["gflops"], g["mem_bandwidth_gbps"]) for g in gpus] == [(50_000.0, 3000.0)] * 2
    other = cached_gpu_benchmarks(state, "other-machine", gpus[:1], tmp_path, measure_gpus=partial)
    assert other.detail == "half" and runs == [1, 2, 1]
    assert set(json.loads((state / gpu_benchmark.CACHE_FILE).read_text())) == {"fp"}


def test_a_profile_gpu_keeps_its_benchmark_figures(tmp_path: Path) -> None:
    profile = load_profile(
        fake_profile(
            tmp_path,
            gpus=[{"vram_total": 2**34, "gflops": 80_000, "mem_bandwidth_gbps": 1000}],
        )
    )
    assert profile["gpus"][0]["gflops"] == 80_000.0
    assert profile["gpus"][0]["mem_bandwidth_gbps"] == 1000.0


@pytest.mark.slow
def test_the_measurement_runs_in_a_child_and_reports_the_converted_figures() -> None:
    """On this CPU-only build the child offloads nothing and so times the CPU: the mechanics
    (load, prompt, decode, conversion, JSON back) without a GPU figure."""
    pytest.importorskip("llama_cpp")
    model = smollm2_path()
    got = run_subprocess(model, 0)
    assert got["model"] == model.name
    assert got["n_params"] > 100_000_000 and got["model_bytes"] > 50_000_000
    # The figures follow from the rates it timed (rounded to 0.1 token/s, hence the 2 %).
    from_prompt = 2 * got["n_params"] * got["prompt_tokens_per_s"] / 1e9
    from_decode = got["model_bytes"] * got["decode_tokens_per_s"] / 1e9
    assert got["gflops"] == pytest.approx(from_prompt, rel=0.02)
    assert got["mem_bandwidth_gbps"] == pytest.approx(from_decode, rel=0.02)
    print(f"\n[gpu benchmark on the CPU build] {got}")
