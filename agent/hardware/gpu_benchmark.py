"""A short GPU benchmark: a small model's prompt processing and decode with every layer on one GPU.

When the llama.cpp build has a GPU backend and NVML reports GPUs, each GPU runs the smallest GGUF
in the models dir (at most MAX_MODEL_BYTES) with all layers offloaded: a PROMPT_TOKENS prompt in
one batch, then DECODE_TOKENS single-token steps. The figures the scheduler weighs follow from
the model, not from a peak table:

- compute: a forward pass costs about 2 FLOPs per parameter per token, so prompt processing at
  ``t`` tokens/s is ``2 · n_params · t`` FLOPS (attention's share is small at this length);
- memory bandwidth: each decode step reads every weight once, so decode at ``t`` tokens/s moves
  ``model_bytes · t`` bytes/s (an effective figure, below the card's peak: what decode gets).

Each GPU is measured in a subprocess (``main`` below: a GGUF path and ``--gpu N``), so the agent
process never holds a GPU context (its VRAM would be missing from what the node offers), and a
driver crash costs the benchmark, not the agent. Results are cached per hardware fingerprint and
model file. Without a GPU backend (the CPU-only wheel: llama_supports_gpu_offload() is true there
too, since an RPC build can offload to RPC servers, so the backend's devices are what is checked),
without a model yet, or when a run fails, nothing is reported for that GPU and the controller
uses its assumption (apps/jobs/selectors.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.protocol import GpuInfo
from agent.runtime.ggml import DeviceInfo, Ggml, GgmlUnavailable, load_llama_cpp_backends

log = logging.getLogger("agent.hardware.gpu_benchmark")

CACHE_FILE = "gpu_benchmark.json"
PROMPT_TOKENS = 512
DECODE_TOKENS = 32
MAX_MODEL_BYTES = 4 * 2**30  # a "small" model: loads in seconds on any GPU worth measuring
RUN_TIMEOUT_S = 180.0  # one GPU's subprocess: model load plus two short timings
# What the controller does with a GPU whose figures no challenge verified (apps/jobs/selectors.py).
ASSUMPTION = (
    "the controller plans an unverified GPU at a floor (half the node's CPU figures), never as "
    "the primary"
)


def gflops_from_prompt(*, n_params: int, tokens: int, seconds: float) -> float:
    """Compute rate of a prompt pass: 2 FLOPs per parameter per token, in GFLOPS."""
    if n_params <= 0 or tokens <= 0 or seconds <= 0:
        raise ValueError(
            f"n_params, tokens and seconds must be positive (got {n_params}, {tokens}, {seconds})"
        )
    return round(2.0 * n_params * tokens / seconds / 1e9, 2)


def bandwidth_from_decode(*, model_bytes: int, tokens: int, seconds: float) -> float:
    """Effective memory bandwidth of decode: every weight read once per token, in GB/s."""
    if model_bytes <= 0 or tokens <= 0 or seconds <= 0:
        raise ValueError(
            f"model_bytes, tokens and seconds must be positive "
            f"(got {model_bytes}, {tokens}, {seconds})"
        )
    return round(model_bytes * tokens / seconds / 1e9, 2)


@dataclass(frozen=True)
class GpuBackend:
    """Whether this llama.cpp can run layers on a GPU, and on which (ggml's device list)."""

    available: bool
    devices: tuple[str, ...]
    detail: str


def gpu_backend() -> GpuBackend:
    """The GPUs ggml can offload to, read the way the RPC worker reads its devices
    (agent/runtime/ggml.py): without importing llama_cpp. llama_supports_gpu_offload() would not
    tell, since it is true on the RPC build without any GPU: the device list is what does."""
    try:
        ggml = Ggml()
        ggml.backend_load_all()  # a GPU backend built as a loadable module registers here
        devs = ggml.devices()
    except (GgmlUnavailable, OSError) as exc:
        return GpuBackend(False, (), f"llama-cpp-python is not available ({exc})")
    devices = _gpu_descriptions(devs)
    if not devices:
        return GpuBackend(
            False,
            (),
            "no GPU backend in this llama.cpp build (its devices: "
            f"{', '.join(d.name for d in devs) or 'none found'}); build one with "
            "RACON_LLAMA_BACKENDS=cuda make install (GGML_CUDA; or vulkan, hip, metal) to use a GPU",
        )
    return GpuBackend(True, tuple(devices), f"llama.cpp GPU backend: {', '.join(devices)}")


def _gpu_descriptions(devs: list[DeviceInfo]) -> list[str]:
    """Descriptions of the devices llama.cpp offloads to, in its main_gpu order: the discrete
    GPUs (RPC servers aside), else the integrated ones (src/llama.cpp, llama_model_load)."""
    gpus = [d.description for d in devs if d.type == "gpu" and not d.name.startswith("RPC")]
    return gpus or [d.description for d in devs if d.type == "igpu"]


def pick_model(models_dir: Path) -> Path | None:
    """The smallest GGUF in the models dir up to MAX_MODEL_BYTES (no projector, no split part)."""
    if not models_dir.is_dir():
        return None
    found = []
    for path in models_dir.rglob("*.gguf"):
        name = path.name.lower()
        if not path.is_file() or "mmproj" in name or "-of-0" in name:
            continue
        size = path.stat().st_size
        if 0 < size <= MAX_MODEL_BYTES:
            found.append((size, str(path), path))
    return min(found)[2] if found else None


def device_order(gpus: Sequence[GpuInfo], devices: Sequence[str]) -> list[int | None]:
    """For each NVML GPU, its index among llama.cpp's GPU devices (main_gpu), or None.

    NVML lists by PCI bus, CUDA by default fastest first: each GPU takes the first unused device
    with its name (the CUDA backend's description is the same product name), else the device at
    its own position when that one is unused.
    """
    used: set[int] = set()
    out: list[int | None] = []
    for pos, gpu in enumerate(gpus):
        match = next(
            (
                i
                for i, d in enumerate(devices)
                if i not in used and d.strip() == gpu["name"].strip()
            ),
            pos if pos < len(devices) and pos not in used else None,
        )
        if match is not None:
            used.add(match)
        out.append(match)
    return out


def measure(model: Path, main_gpu: int) -> dict[str, Any]:
    """One GPU, in this process: load with every layer on it, time a prompt and a decode."""
    load_llama_cpp_backends()  # a GPU build's backends are modules in llama_cpp/lib
    import llama_cpp  # noqa: PLC0415 - optional (the [agent] extra)

    llm = llama_cpp.Llama(
        str(model),
        n_gpu_layers=-1,
        split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE,
        main_gpu=main_gpu,
        n_ctx=PROMPT_TOKENS + DECODE_TOKENS + 64,
        n_batch=PROMPT_TOKENS,
        n_ubatch=PROMPT_TOKENS,
        verbose=False,
    )
    ctx = llm._ctx.ctx
    n_vocab = int(llm.n_vocab())
    tokens = [(i * 7919 + 13) % n_vocab for i in range(PROMPT_TOKENS + DECODE_TOKENS)]

    def timed(run: Callable[[], None]) -> float:
        start = time.perf_counter()
        run()
        llama_cpp.llama_synchronize(ctx)  # a GPU decode may return before the work is done
        return time.perf_counter() - start

    llm.eval(tokens[:32])  # warm up: kernels, graph allocation
    llm.reset()
    prompt_s = timed(lambda: llm.eval(tokens[:PROMPT_TOKENS]))

    def decode() -> None:
        for t in tokens[PROMPT_TOKENS:]:
            llm.eval([t])

    decode_s = timed(decode)
    n_params = int(llm._model.n_params())
    model_bytes = int(llm._model.size())
    llm.close()
    return {
        "gflops": gflops_from_prompt(n_params=n_params, tokens=PROMPT_TOKENS, seconds=prompt_s),
        "mem_bandwidth_gbps": bandwidth_from_decode(
            model_bytes=model_bytes, tokens=DECODE_TOKENS, seconds=decode_s
        ),
        "prompt_tokens_per_s": round(PROMPT_TOKENS / prompt_s, 1),
        "decode_tokens_per_s": round(DECODE_TOKENS / decode_s, 1),
        "model": model.name,
        "n_params": n_params,
        "model_bytes": model_bytes,
    }


# Not `-m agent.hardware.gpu_benchmark`: the package imports this module first, and runpy warns.
_CHILD = "import sys; from agent.hardware.gpu_benchmark import main; sys.exit(main(sys.argv[1:]))"


def run_subprocess(model: Path, main_gpu: int) -> dict[str, Any]:
    """measure() in a child process; raises RuntimeError with its output when it fails."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), "--gpu", str(main_gpu)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@dataclass
class GpuBenchmarks:
    """What the GPU benchmark found: per NVML GPU its figures or None, and why."""

    measured: list[dict[str, Any] | None] = field(default_factory=list)
    detail: str = ""

    def apply(self, gpus: list[GpuInfo]) -> None:
        """Put each measured GPU's gflops and mem_bandwidth_gbps on its inventory entry."""
        for gpu, got in zip(gpus, self.measured, strict=False):
            if got is not None:
                gpu["gflops"] = float(got["gflops"])
                gpu["mem_bandwidth_gbps"] = float(got["mem_bandwidth_gbps"])


def gpu_benchmarks(
    gpus: Sequence[GpuInfo],
    models_dir: Path,
    *,
    backend: Callable[[], GpuBackend] = gpu_backend,
    runner: Callable[[Path, int], dict[str, Any]] = run_subprocess,
) -> GpuBenchmarks:
    """Measure each GPU, or say why not (every GPU then falls back to ASSUMPTION)."""
    none: list[dict[str, Any] | None] = [None] * len(gpus)
    if not gpus:
        return GpuBenchmarks(none, "no GPU reported by NVML")
    found = backend()
    if not found.available:
        return GpuBenchmarks(none, f"{found.detail}; {ASSUMPTION}")
    model = pick_model(models_dir)
    if model is None:
        return GpuBenchmarks(
            none,
            f"{found.detail}, but no GGUF of at most {MAX_MODEL_BYTES / 2**30:.0f} GiB in "
            f"{models_dir} to time yet (measured once one is there); {ASSUMPTION}",
        )
    out = GpuBenchmarks(list(none))
    notes = []
    for pos, main_gpu in enumerate(device_order(gpus, found.devices)):
        if gpus[pos].get("software"):
            # lavapipe: the CPU again, about 36x slower than the CPU build; a minute of shader
            # compiling and decode for a figure the floor already stands for.
            notes.append(f"gpu {gpus[pos]['index']}: a software device, not timed")
            continue
        if main_gpu is None:
            notes.append(f"gpu {gpus[pos]['index']}: no llama.cpp device for it")
            continue
        try:
            out.measured[pos] = runner(model, main_gpu)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
            notes.append(f"gpu {gpus[pos]['index']}: benchmark failed ({exc})")
            log.warning("GPU benchmark on gpu %s failed: %s", gpus[pos]["index"], exc)
    out.detail = (
        f"measured with {model.name} ({PROMPT_TOKENS}-token prompt, {DECODE_TOKENS} decode)"
    )
    if notes:
        out.detail += f"; {'; '.join(notes)}; {ASSUMPTION} for those"
    return out


def cached_gpu_benchmarks(
    state_dir: Path,
    fingerprint: str,
    gpus: Sequence[GpuInfo],
    models_dir: Path,
    *,
    measure_gpus: Callable[[Sequence[GpuInfo], Path], GpuBenchmarks] = gpu_benchmarks,
) -> GpuBenchmarks:
    """The GPU figures for this fingerprint: from the cache, else measured. Only a run that
    measured every GPU is stored, so a node that had no model yet measures once it has one."""
    path = state_dir / CACHE_FILE
    try:
        hit = json.loads(path.read_text()).get(fingerprint)
    except (OSError, ValueError, AttributeError):
        hit = None
    if (
        isinstance(hit, dict)
        and isinstance(hit.get("measured"), list)
        and len(hit["measured"]) == len(gpus)
        and all(isinstance(m, dict) for m in hit["measured"])
    ):
        return GpuBenchmarks(hit["measured"], f"{hit.get('detail', '')} (cached)")
    if gpus:
        log.info("running the GPU benchmark (a small model on each GPU, seconds each)")
    result = measure_gpus(gpus, models_dir)
    if gpus and all(m is not None for m in result.measured):
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        entry = {"measured": result.measured, "detail": result.detail, "measured_at": time.time()}
        tmp.write_text(json.dumps({fingerprint: entry}, indent=2))
        tmp.replace(path)
    return result


def doctor_check(
    gpus: Sequence[GpuInfo],
    detail: str,
    *,
    backend: Callable[[], GpuBackend] = gpu_backend,
) -> tuple[bool | None, str]:
    """`node-agent doctor`'s line: ok when every GPU was measured, skipped (None) otherwise,
    saying why (no GPU backend is said even without a GPU: a build that cannot use one)."""
    if gpus and all("gflops" in g for g in gpus):
        return True, detail
    found = backend()
    if not found.available:
        return None, f"{found.detail}; {ASSUMPTION}"
    return None, detail if gpus else f"{found.detail}; no GPU reported by NVML"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_benchmark")
    parser.add_argument("model", type=Path, help="a GGUF file")
    parser.add_argument("--gpu", type=int, default=0, help="llama.cpp's main_gpu index")
    args = parser.parse_args(argv)
    if not args.model.is_file():
        parser.error(f"model: no such file {args.model}")
    print(json.dumps(measure(args.model, args.gpu)))
    return 0
