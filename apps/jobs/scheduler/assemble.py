"""Plan assembly: the chosen evaluation laid out in llama.cpp's order, sized and predicted."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .cost import compute_buffer_bytes, hop_s, host_buffer_bytes, kv_bytes_per_layer, layer_times
from .evaluate import _Ctx, _Dev, _Eval, _Node
from .explain import _explain
from .inputs import PlacementRequest
from .plan import Plan, PlanDevice


def _ordered_devices(ev: _Eval, ctx_nodes: Sequence[_Node]) -> list[tuple[_Dev, int]]:
    """The evaluation's devices in llama.cpp's order: primary CPU, remote nodes, primary GPUs."""
    primary = ev.primary
    counts = {k: c for k, c in ev.assign.items() if c > 0}
    out = ev.out

    def node_devices(node: _Node) -> list[tuple[_Dev, int]]:
        ds = [(d, counts[id(d)]) for d in node.devs if id(d) in counts and d is not node.cpu]
        cpu = node.cpu
        if cpu is not None and id(cpu) in counts and node is not primary:
            ds.insert(0, (cpu, counts[id(cpu)]))
        # The output device runs last within its node.
        ds.sort(key=lambda t: t[0] is out)
        return ds

    order: list[tuple[_Dev, int]] = []
    assert primary.cpu is not None
    order.append((primary.cpu, counts.get(id(primary.cpu), 0)))
    # Remote order does not change the cost (every hop goes through the primary), so keep the
    # cluster's order, with the node holding the output last as llama.cpp requires.
    rank = {id(n): i for i, n in enumerate(ctx_nodes)}
    remote = sorted(
        ev.remote, key=lambda n: (out is not None and out.node is n, rank.get(id(n), 0))
    )
    for node in remote:
        order.extend(node_devices(node))
    order.extend(node_devices(primary))
    return order


def _device_memory(
    ctx: _Ctx,
    ev: _Eval,
    d: _Dev,
    start: int,
    end: int,
    holds_output: bool,
    is_primary_cpu: bool,
    copies: int,
    request: PlacementRequest | None = None,
) -> int:
    profile = ctx.profile
    request = request or ctx.request
    n = end - start
    raw = sum(profile.layer_bytes[start:end]) + n * kv_bytes_per_layer(profile, request)
    if is_primary_cpu:
        raw += host_buffer_bytes(profile, request)
        if ev.out is None:
            raw += profile.output_bytes + compute_buffer_bytes(
                profile, request, holds_layers=True, holds_output=True, cost=ctx.cost
            )
        else:
            raw += compute_buffer_bytes(
                profile,
                request,
                holds_layers=n > 0,
                holds_output=False,
                copies=copies,
                cost=ctx.cost,
            )
    else:
        if holds_output:
            raw += profile.output_bytes
        raw += compute_buffer_bytes(
            profile,
            request,
            holds_layers=n > 0,
            holds_output=holds_output,
            copies=copies,
            cost=ctx.cost,
        )
    return int(math.ceil(raw * ctx.margin))


def _predict(ctx: _Ctx, ev: _Eval, order: list[tuple[_Dev, int]]) -> tuple[float, float]:
    """(decode seconds per token, prompt seconds) for the plan as laid out."""
    profile, request = ctx.profile, ctx.request
    tg = pp = 0.0
    passes = math.ceil(max(1, request.prompt_tokens) / request.n_batch)
    overhead = ctx.cost.layer_overhead_ms / 1000
    for d, c in order:
        tg += c * d.t_tg
        if c:
            pp += c * (layer_times(profile, request, d.snap)[1] + passes * overhead)
    out_dev = ev.out if ev.out is not None else ev.primary.cpu
    assert out_dev is not None
    tg += out_dev.out_tg
    pp += out_dev.out_tg
    for node in ev.remote:
        link = ctx.cluster.link(ev.primary.snap.node_id, node.snap.node_id)
        holds = ev.out is not None and ev.out.node is node
        tg += hop_s(profile, request, link, holds_output=holds, prompt=False, cost=ctx.cost)
        pp += hop_s(profile, request, link, holds_output=holds, prompt=True, cost=ctx.cost)
    return tg, pp


def _layout(ctx: _Ctx, ev: _Eval) -> list[tuple[_Dev, int, int, bool, bool]]:
    """(device, layer_start, layer_end, holds_output, is_primary_cpu) in llama.cpp's order."""
    out: list[tuple[_Dev, int, int, bool, bool]] = []
    start = 0
    for i, (d, c) in enumerate(_ordered_devices(ev, ctx.nodes)):
        is_primary_cpu = i == 0
        holds_output = (ev.out is d) or (ev.out is None and is_primary_cpu)
        out.append((d, start, start + c, holds_output, is_primary_cpu))
        start += c
    return out


def _overflowing_device(
    ctx: _Ctx, ev: _Eval, layout: list[tuple[_Dev, int, int, bool, bool]], n_parallel: int
) -> _Dev | None:
    """The first device of the plan whose memory with n_parallel slots exceeds its free bytes."""
    req = dataclasses.replace(ctx.request, n_parallel=n_parallel)
    copies = ctx.cost.pipeline_copies if ev.pipeline else 1
    for d, start, end, holds_output, is_primary_cpu in layout:
        mem = _device_memory(ctx, ev, d, start, end, holds_output, is_primary_cpu, copies, req)
        if mem > d.snap.free_bytes:
            return d
    return None


def _slots_that_fit(ctx: _Ctx, ev: _Eval, limit: int) -> int:
    """The most slots (1..limit) whose KV fits on every device of the plan as laid out.

    Memory grows with the slot count on every device (KV per layer, the logits buffer), so the
    largest fitting count is found by bisection. 0 when not even one slot fits.
    """
    layout = _layout(ctx, ev)
    if _overflowing_device(ctx, ev, layout, 1) is not None:
        return 0
    lo, hi = 1, max(1, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _overflowing_device(ctx, ev, layout, mid) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _finish_plan(ctx: _Ctx, ev: _Eval, notes: list[str], asked: PlacementRequest) -> Plan:
    """Build the plan; when the request left n_parallel open, with as many slots as fit.

    The search ran with one slot (ctx.request): layers go where they run fastest, and the slots
    take what memory is left on the devices chosen, capped at asked.max_parallel.
    """
    if asked.n_parallel is not None:
        return _build_plan(ctx, ev, [*notes, f"slots: {asked.n_parallel} (set by the request)"])
    fit = _slots_that_fit(ctx, ev, max(1, asked.max_parallel))
    n = max(1, fit)
    line = f"slots: {n} of {ctx.request.n_ctx} tokens each (the KV of every slot fits every device"
    line += f"; capped at {asked.max_parallel})" if n >= asked.max_parallel else ")"
    return _build_plan(
        ctx, ev, [*notes, line], request=dataclasses.replace(ctx.request, n_parallel=n)
    )


def _build_plan(
    ctx: _Ctx, ev: _Eval, notes: list[str], request: PlacementRequest | None = None
) -> Plan:
    profile = ctx.profile
    request = request or ctx.request
    primary = ev.primary
    layout = _layout(ctx, ev)
    order = [(d, end - start) for d, start, end, _, _ in layout]
    offload = order[1:]
    copies = ctx.cost.pipeline_copies if ev.pipeline else 1
    devices: list[PlanDevice] = []
    for d, start, end, holds_output, is_primary_cpu in layout:
        mem = _device_memory(ctx, ev, d, start, end, holds_output, is_primary_cpu, copies, request)
        node = d.node.snap
        devices.append(
            PlanDevice(
                node_id=node.node_id,
                device=d.snap.device,
                kind=d.snap.kind,
                layer_start=start,
                layer_end=end,
                memory_bytes=mem,
                endpoint=None if d.node is primary else node.endpoint,
                holds_output=holds_output,
                free_bytes=d.snap.free_bytes,
                decode_ms=round(
                    ((end - start) * d.t_tg + (d.out_tg if holds_output else 0.0)) * 1000, 4
                ),
                gflops=d.snap.gflops,
                mem_bandwidth_gbps=d.snap.mem_bandwidth_gbps,
            )
        )
    start = layout[-1][2] if layout else 0
    assert start == profile.n_layer, "every layer is placed exactly once"
    k = order[0][1]
    if offload:
        n_gpu_layers = profile.n_layer + 1 - k
        split = [float(c) for _, c in offload]
        split[-1] += 1.0  # the output layer counts as one more on the last offload device
    else:
        n_gpu_layers, split = 0, []
    tg, pp = _predict(ctx, ev, order)
    explanation = _explain(ctx, ev, devices, tg, notes)
    return Plan(
        primary_node_id=primary.snap.node_id,
        devices=tuple(devices),
        tensor_split=tuple(split),
        n_gpu_layers=n_gpu_layers,
        n_threads=max(1, primary.snap.threads),
        n_ctx=request.n_ctx,
        n_parallel=request.n_parallel or 1,
        n_batch=min(request.n_batch, request.n_ctx),
        flash_attn=request.flash_attn,
        predicted_ttft_ms=round(pp * 1000, 3),
        predicted_tokens_per_s=round(1.0 / tg, 3) if tg > 0 else math.inf,
        explanation=tuple(explanation),
    )
