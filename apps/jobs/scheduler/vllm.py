"""Plans for the vLLM engine (issue 30): one node, weights plus the KV cache it is given.

vLLM cannot be split over ggml-rpc, so a vLLM plan is one node that holds the whole model: its
weights as vLLM loads them (float32 on the CPU: the safetensors directory's size, or twice that
for a 16-bit directory), the KV cache it is given (``VLLM_CPU_KVCACHE_SPACE``, whole GiB, for
``n_ctx`` tokens in each of ``n_parallel`` sequences) and the runtime's own memory (torch and
vLLM's processes). A model that fits no single node with the engine is refused here, naming
llama.cpp, which can split it. vLLM's own multi-node modes are out of scope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .eligibility import _select_nodes
from .inputs import ClusterSnapshot, GiB, NodeSnapshot, PlacementRequest
from .plan import PlacementRefused, Plan, PlanDevice, fmt_bytes

# torch, vLLM's API server and its engine core on the CPU, beside weights and KV: about 1.2 GiB
# resident measured with SmolLM2-135M (vllm-cpu 0.32.0, eager); rounded up.
VLLM_RUNTIME_BYTES = int(1.5 * GiB)
VLLM_DTYPE_BYTES = 4  # the agent runs vLLM in float32 (exact tokens across runs on the CPU)


@dataclass(frozen=True)
class VllmModel:
    """What a vLLM plan needs to know about a model directory."""

    weights_bytes: int  # as loaded (float32)
    n_layer: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layer * self.n_head_kv * self.head_dim * VLLM_DTYPE_BYTES

    @classmethod
    def from_config(
        cls,
        *,
        size: int,
        dtype: str,
        n_layer: int,
        n_embd: int,
        n_head: int,
        n_head_kv: int,
        n_ctx_train: int = 0,
    ) -> VllmModel:
        """From a registered model directory's figures (config.json): its files' size at the
        stored dtype, scaled to float32."""
        stored = 2 if dtype in ("bfloat16", "float16", "bf16", "f16") else 4
        head_dim = n_embd // n_head if n_head else 64
        return cls(
            weights_bytes=size * VLLM_DTYPE_BYTES // stored,
            n_layer=max(1, n_layer),
            n_head_kv=max(1, n_head_kv or n_head),
            head_dim=max(1, head_dim),
            n_ctx_train=n_ctx_train,
        )


def kv_given(model: VllmModel, n_ctx: int, n_parallel: int) -> int:
    """The KV cache vLLM is given for n_parallel sequences of n_ctx tokens: whole GiB, since
    VLLM_CPU_KVCACHE_SPACE counts in GiB."""
    need = model.kv_bytes_per_token * n_ctx * max(1, n_parallel)
    return max(1, math.ceil(need / GiB)) * GiB


def vllm_memory(model: VllmModel, n_ctx: int, n_parallel: int) -> int:
    return model.weights_bytes + kv_given(model, n_ctx, n_parallel) + VLLM_RUNTIME_BYTES


def _cpu_free(node: NodeSnapshot) -> int:
    return sum(d.free_bytes for d in node.devices if d.kind == "cpu")


def plan_vllm(model: VllmModel, cluster: ClusterSnapshot, request: PlacementRequest) -> Plan:
    """The best single node with the vLLM engine, or PlacementRefused saying why none is."""
    if model.n_ctx_train and request.n_ctx > model.n_ctx_train:
        raise PlacementRefused(
            f"n_ctx {request.n_ctx} is above the model's trained context {model.n_ctx_train}",
            code="invalid_request",
        )
    if request.n_parallel is not None and request.n_parallel < 1:
        raise PlacementRefused("n_parallel must be at least 1", code="invalid_request")
    ready, degraded, notes = _select_nodes(cluster, request)
    pool = [n for n in ready + degraded if n.may_be_primary]
    with_engine = [n for n in pool if "vllm" in n.engines]
    if not with_engine:
        others = ", ".join(n.name or n.node_id for n in pool[:5]) or "none"
        raise PlacementRefused(
            "no eligible node has the vLLM engine (eligible: "
            f"{others}; a node offers it with scripts/install-vllm.sh and "
            "RACON_ENGINES=llamacpp,vllm)" + (f"; {'; '.join(notes)}" if notes else ""),
        )
    slots = [request.n_parallel] if request.n_parallel else range(request.max_parallel, 0, -1)
    best: tuple[float, int, NodeSnapshot] | None = None  # (predicted tok/s, slots, node)
    closest: tuple[int, NodeSnapshot] | None = None  # (missing bytes, node) at one slot
    for node in with_engine:
        free = _cpu_free(node)
        fitting = next((s for s in slots if vllm_memory(model, request.n_ctx, s) <= free), 0)
        if not fitting:
            missing = vllm_memory(model, request.n_ctx, slots[-1] if slots else 1) - free
            if closest is None or missing < closest[0]:
                closest = (missing, node)
            continue
        cpu = next(d for d in node.devices if d.kind == "cpu")
        rate = cpu.mem_bandwidth_gbps * 1e9 / max(1, model.weights_bytes)
        tier = 1.0 if node in ready else 0.5  # a DEGRADED node only when no READY one fits
        key = (rate * tier, fitting, node)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        assert closest is not None
        missing, node = closest
        raise PlacementRefused(
            f"no single node with the vLLM engine can hold the model: it needs "
            f"{fmt_bytes(vllm_memory(model, request.n_ctx, slots[-1] if slots else 1))} "
            f"(weights {fmt_bytes(model.weights_bytes)} + KV "
            f"{fmt_bytes(kv_given(model, request.n_ctx, 1))} + runtime "
            f"{fmt_bytes(VLLM_RUNTIME_BYTES)}); the closest, {node.name or node.node_id}, lacks "
            f"{fmt_bytes(missing)}. vLLM runs on one node (it cannot be split over ggml-rpc): "
            "deploy the model with engine llamacpp, which can split it",
            missing,
            (node.node_id,),
        )
    rate, n_parallel, node = best
    cpu = next(d for d in node.devices if d.kind == "cpu")
    kv = kv_given(model, request.n_ctx, n_parallel)
    memory = model.weights_bytes + kv + VLLM_RUNTIME_BYTES
    tokens_per_s = cpu.mem_bandwidth_gbps * 1e9 / max(1, model.weights_bytes)
    # Prefill: about 2 flops per weight per prompt token (float32 weights: 4 bytes each).
    ttft_ms = request.prompt_tokens * 2 * (model.weights_bytes / 4) / max(1e-9, cpu.gflops * 1e9)
    explanation = (
        f"engine vllm on {node.name or node.node_id}: one node (vLLM cannot be split over "
        "ggml-rpc)",
        f"memory {fmt_bytes(memory)} = weights {fmt_bytes(model.weights_bytes)} (float32) + KV "
        f"given {fmt_bytes(kv)} ({n_parallel} x {request.n_ctx} tokens) + runtime "
        f"{fmt_bytes(VLLM_RUNTIME_BYTES)}; {fmt_bytes(_cpu_free(node))} free there",
        *notes,
    )
    device = PlanDevice(
        node_id=node.node_id,
        device="CPU",
        kind="cpu",
        layer_start=0,
        layer_end=model.n_layer,
        memory_bytes=memory,
        endpoint=None,
        holds_output=True,
        free_bytes=_cpu_free(node),
        decode_ms=round(1000.0 / tokens_per_s, 3) if tokens_per_s > 0 else 0.0,
        gflops=cpu.gflops,
        mem_bandwidth_gbps=cpu.mem_bandwidth_gbps,
    )
    return Plan(
        primary_node_id=node.node_id,
        devices=(device,),
        tensor_split=(),
        n_gpu_layers=0,
        n_threads=node.threads,
        n_ctx=request.n_ctx,
        n_parallel=n_parallel,
        n_batch=request.n_batch,
        flash_attn=False,
        predicted_ttft_ms=round(ttft_ms, 1),
        predicted_tokens_per_s=round(tokens_per_s, 2),
        explanation=explanation,
        engine="vllm",
        kv_bytes=kv,
    )


# Where each engine wins (FACTS.md "vLLM on the CPU", bench/engines.py): side by side on one core,
# vLLM made 0.55-0.67x llama-server's single-stream speed and 2.1-3.2x its aggregate at 8
# concurrent streams. So the scheduler picks vLLM for a deployment that serves several streams at
# once, and llama.cpp for one or few.
VLLM_AUTO_MIN_PARALLEL = 4


def choose_engine(
    *,
    vllm: Plan | PlacementRefused | None,
    llamacpp: Plan | PlacementRefused | None,
    min_parallel: int = VLLM_AUTO_MIN_PARALLEL,
) -> tuple[str, str]:
    """The scheduler's engine for a deployment the operator left to it, and why (the preview's
    first line). ``vllm``/``llamacpp``: each engine's plan, its refusal, or None when the model
    has no file that engine runs (no safetensors directory, no GGUF).

    vLLM when the model has a directory, a node with the engine holds it whole, and the plan
    serves at least ``min_parallel`` streams at once (vLLM's batching wins there); or when
    llama.cpp cannot place the model at all. Otherwise llama.cpp, which is faster per stream
    and can split a model over several nodes.
    """
    if vllm is None:
        return "llamacpp", (
            "engine llamacpp (the scheduler's choice): the model has no safetensors directory, "
            "and vLLM on the CPU cannot run GGUF"
        )
    if isinstance(vllm, PlacementRefused):
        if llamacpp is None:  # nothing else can serve it: vLLM's refusal is the answer
            return "vllm", f"engine vllm: the model has no GGUF for llama.cpp; {vllm.reason}"
        return "llamacpp", f"engine llamacpp (the scheduler's choice): not vLLM, {vllm.reason}"
    llama_out = (
        "the model has no GGUF"
        if llamacpp is None
        else f"llama.cpp cannot place it ({llamacpp.reason})"
        if isinstance(llamacpp, PlacementRefused)
        else None
    )
    if llama_out is not None:
        return "vllm", (
            f"engine vllm (the scheduler's choice): {llama_out}, and one node with the vLLM "
            "engine holds the model directory"
        )
    if vllm.n_parallel < min_parallel:
        return "llamacpp", (
            f"engine llamacpp (the scheduler's choice): {vllm.n_parallel} concurrent "
            f"stream{'s' if vllm.n_parallel != 1 else ''}, and below {min_parallel} llama.cpp is "
            "faster per stream (vLLM made 0.55-0.67x its single-stream speed); ask for "
            "engine vllm to override"
        )
    return "vllm", (
        "engine vllm (the scheduler's choice): a safetensors directory, one node with the vLLM "
        f"engine holds it, and {vllm.n_parallel} concurrent streams, where vLLM's "
        "batching gives more aggregate throughput (2.1-3.2x llama.cpp's at 8 streams, with a "
        "shorter time to first token); ask for engine llamacpp to override"
    )
