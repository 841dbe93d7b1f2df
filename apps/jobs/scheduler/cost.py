"""The cost model: llama.cpp's memory needs and the roofline latency of layers and hops. Pure."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from apps.models_repo.profile import ModelProfile

from .inputs import LOCAL_LINK, DeviceSnapshot, Link, MiB, PlacementRequest


@dataclass(frozen=True)
class CostModel:
    """Constants of the latency and memory model; defaults are llama.cpp's and a LAN's."""

    # Fixed cost per remote node per forward pass on top of the RTT: serialising the graph
    # call, socket wake-ups and the worker's thread hand-off (ggml-rpc is one request stream).
    rpc_overhead_ms: float = 0.3
    # A plan within this fraction of the fastest one is preferred when it uses fewer nodes,
    # then when its primary already holds the model file. Predictions are rough (±30% is the
    # target), so a split must predict clearly faster to be worth another node that can fail.
    prefer_fewer_tolerance: float = 0.05
    # ggml's scheduler keeps this many copies of each split's inputs when it pipelines across
    # devices (GGML_SCHED_MAX_COPIES; llama.cpp enables it when every layer is offloaded to more
    # than one device, RPC devices included).
    pipeline_copies: int = 4
    # Fixed part of every compute buffer (graph metadata, small inputs). With the estimate in
    # compute_buffer_bytes this lands 1-30% above what llama.cpp reported for SmolLM2 (CPU and
    # RPC devices, flash attention on and off, n_ctx 2048 and 8192, with and without pipelining).
    compute_buffer_fixed_bytes: int = 4 * MiB
    # Per layer per token dispatch cost on a device (kernel launches, thread barriers).
    layer_overhead_ms: float = 0.01

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_COST = CostModel()


def kv_bytes_per_layer(profile: ModelProfile, request: PlacementRequest) -> int:
    """KV cache of one layer for n_ctx tokens in each of n_parallel slots (None counts as 1)."""
    return profile.kv_bytes_per_token_per_layer * request.n_ctx * (request.n_parallel or 1)


def compute_buffer_bytes(
    profile: ModelProfile,
    request: PlacementRequest,
    *,
    holds_layers: bool,
    holds_output: bool,
    copies: int = 1,
    cost: CostModel = DEFAULT_COST,
) -> int:
    """Estimate of llama.cpp's compute buffer on one device (its worst-case n_batch graph).

    ggml-alloc reuses memory between layers, so the peak is one layer's live tensors for a full
    batch. Pipeline parallelism (copies > 1) duplicates only each split's input tensors
    (ggml_backend_sched marks the copies as inputs/outputs), not the whole buffer.
    """
    nb = max(1, min(request.n_batch, request.n_ctx))
    n_kv = -(-request.n_ctx // 256) * 256  # llama.cpp pads the KV length it reserves for
    n_ff = profile.n_ff or 4 * profile.n_embd
    copies = max(1, copies)
    # Split inputs: the incoming hidden state, the KQ mask, positions and token ids.
    mask_bytes = 2 if request.flash_attn else 4
    inputs = nb * profile.n_embd * 4 + n_kv * nb * mask_bytes + nb * 8
    residual = nb * profile.n_embd * 4
    if not holds_layers and not holds_output:
        # A primary CPU with no layers still embeds the batch and stages every split's inputs.
        return cost.compute_buffer_fixed_bytes + residual + inputs * copies
    peak = 0
    if holds_layers:
        # One layer for the whole batch: FFN gate/up/activation and the residual stream...
        peak = inputs + nb * 4 * (3 * n_ff + 4 * profile.n_embd)
        if request.flash_attn:
            peak += nb * profile.n_head * profile.head_dim * 4 * 2
        else:
            # ...plus, without flash attention, the attention scores over the whole context.
            peak += n_kv * nb * profile.n_head * 4
    if holds_output:
        # n_outputs_max defaults to n_batch: the worst-case graph reserves logits for all of it.
        # ggml-alloc frees the layers' tensors by then, so this is a separate peak, not a sum.
        peak = max(peak, nb * profile.n_vocab * 4 + inputs + residual)
    return cost.compute_buffer_fixed_bytes + peak + inputs * (copies - 1)


def host_buffer_bytes(profile: ModelProfile, request: PlacementRequest) -> int:
    """What the primary's CPU holds whatever the split: embeddings, other tensors, logits."""
    return (
        profile.embedding_bytes
        + profile.other_bytes
        + profile.n_vocab * 4 * max(1, request.n_parallel or 1)  # the output (logits) buffer
    )


def _roofline_s(flops: float, nbytes: float, dev: DeviceSnapshot) -> float:
    compute = flops / (max(dev.gflops, 1e-6) * 1e9)
    memory = nbytes / (max(dev.mem_bandwidth_gbps, 1e-6) * 1e9)
    return max(compute, memory)


def layer_times(
    profile: ModelProfile, request: PlacementRequest, dev: DeviceSnapshot
) -> tuple[float, float]:
    """Seconds for one mean layer on dev: (one decoded token, the whole prompt)."""
    n = max(1, profile.n_layer)
    w_bytes = sum(profile.layer_bytes) / n
    w_flops = 2.0 * sum(profile.layer_params) / n
    ctx = max(1, request.prompt_tokens)
    kv = profile.kv_bytes_per_token_per_layer
    # QK^T and softmax(QK^T)V: 2 matmuls of n_head x head_dim x ctx, 2 FLOPs per MAC.
    attn_flops_per_ctx = 4.0 * profile.n_head * profile.head_dim
    tg = _roofline_s(w_flops + attn_flops_per_ctx * ctx, w_bytes + kv * ctx, dev)
    # Prompt: weights are read once per batch, every token computes; causal attention ~ ctx/2.
    pp = 0.0
    remaining = ctx
    while remaining > 0:
        chunk = min(remaining, request.n_batch)
        done = ctx - remaining
        flops = chunk * (w_flops + attn_flops_per_ctx * (done + chunk / 2))
        pp += _roofline_s(flops, w_bytes + kv * (done + chunk), dev)
        remaining -= chunk
    return tg, pp


def output_time_s(profile: ModelProfile, dev: DeviceSnapshot) -> float:
    """Seconds for the output norm + LM head for one token on dev (prompts output one row)."""
    return _roofline_s(2.0 * profile.output_params, profile.output_bytes, dev)


def hop_s(
    profile: ModelProfile,
    request: PlacementRequest,
    link: Link,
    *,
    holds_output: bool,
    prompt: bool,
    cost: CostModel = DEFAULT_COST,
) -> float:
    """Seconds one remote node adds per forward pass: RTT + overhead + bytes in and out."""
    if link is LOCAL_LINK or link.rtt_ms == 0 and math.isinf(link.bandwidth_mbps):
        return 0.0
    tokens = max(1, request.prompt_tokens) if prompt else 1
    passes = math.ceil(tokens / request.n_batch) if prompt else 1
    bytes_in = tokens * profile.activation_bytes
    # Only the last prompt token produces logits (n_outputs = 1).
    bytes_out = profile.logits_bytes if holds_output else tokens * profile.activation_bytes
    bw = max(link.bandwidth_mbps, 1e-6) * 1e6 / 8
    return passes * (link.rtt_ms + cost.rpc_overhead_ms) / 1000 + (bytes_in + bytes_out) / bw
