"""Device pins and unverified GPUs in the pure scheduler (issue 25): plans by llama.cpp device
name, never asking a device for more than its free memory."""

from __future__ import annotations

import pytest

from apps.jobs.scheduler import (
    ClusterSnapshot,
    PlacementRefused,
    PlacementRequest,
    plan_placement,
)
from tests.support.scheduler_devices import LLAMA_8B, TINY, cpu, gpu, node


def test_a_pinned_slow_gpu_takes_the_layers_the_scheduler_would_leave_on_the_cpu() -> None:
    # lavapipe: 2 GiB, about 36x slower than the CPU. Unpinned, the CPU runs it all.
    snap = ClusterSnapshot(nodes=(node("a", cpu("a", 16), gpu("a", "Vulkan0", 2, 2.0, 0.5)),))
    free = plan_placement(TINY, snap, PlacementRequest())
    assert [d.device for d in free.layer_devices] == ["CPU"]
    pinned = plan_placement(TINY, snap, PlacementRequest(pin_devices=("Vulkan0",)))
    assert [(d.device, d.n_layers) for d in pinned.layer_devices] == [("Vulkan0", 30)]
    assert pinned.n_gpu_layers == 31 and pinned.tensor_split == (31.0,)
    assert pinned.offload_device_names() == ["Vulkan0"]
    # The same pin written node:device, by the node's name.
    named = plan_placement(TINY, snap, PlacementRequest(pin_devices=("host-a:Vulkan0",)))
    assert [d.device for d in named.layer_devices] == ["Vulkan0"]


def test_a_device_pin_over_two_hosts_splits_over_both_and_names_the_rpc_device() -> None:
    snap = ClusterSnapshot(
        nodes=(
            node("a", cpu("a", 16), gpu("a", "Vulkan0", 2, 2.0, 0.5)),
            node("b", cpu("b", 16)),
        )
    )
    plan = plan_placement(TINY, snap, PlacementRequest(pin_devices=("a:Vulkan0", "b:CPU")))
    used = {(d.node_id, d.device) for d in plan.layer_devices}
    assert used == {("a", "Vulkan0"), ("b", "CPU")}
    names = plan.offload_device_names()
    assert len(names) == len(plan.tensor_split)
    assert sorted(n.rstrip("0123456789") for n in names) == ["RPC", "Vulkan"]
    # A worker that also serves a GPU the plan does not use: its device is counted all the same.
    if plan.primary_node_id == "b":
        assert plan.offload_device_names({"a": ["CPU", "Vulkan0"]}) == ["RPC1"]


def test_an_unknown_pinned_device_is_refused_naming_it() -> None:
    snap = ClusterSnapshot(nodes=(node("a", cpu("a", 16)),))
    with pytest.raises(PlacementRefused, match="'CUDA0'.*no such device"):
        plan_placement(TINY, snap, PlacementRequest(pin_devices=("CUDA0",)))
    with pytest.raises(PlacementRefused, match="no node 'nowhere'"):
        plan_placement(TINY, snap, PlacementRequest(pin_devices=("nowhere:CPU",)))


def test_a_node_with_an_unverified_gpu_claim_is_never_the_primary() -> None:
    # "80 GiB, 900 TFLOPS", unverified: planned at the floor (half its CPU), never the primary.
    fake = node("f", cpu("f", 16), gpu("f", "CUDA0", 80, 50.0, 10.0), may_be_primary=False)
    honest = node("h", cpu("h", 16))
    plan = plan_placement(TINY, ClusterSnapshot(nodes=(fake, honest)), PlacementRequest())
    assert plan.primary_node_id == "h"
    # Alone, it may be (a one-machine pool with a GPU), or nothing could be placed at all.
    alone = ClusterSnapshot(nodes=(fake,))
    assert plan_placement(TINY, alone, PlacementRequest()).primary_node_id == "f"
    # The operator's pin of that one node's devices is the exception: a choice, not a claim.
    pinned = plan_placement(TINY, alone, PlacementRequest(pin_devices=("f:CUDA0",)))
    assert pinned.primary_node_id == "f"
    # Pinned beside a verified node, it lends its GPU at the floor, and the other is the primary.
    both = ClusterSnapshot(nodes=(fake, honest))
    split = plan_placement(TINY, both, PlacementRequest(pin_devices=("f:CUDA0", "h:CPU")))
    assert split.primary_node_id == "h"
    (row,) = [d for d in split.devices if d.device == "CUDA0"]
    assert row.n_layers > 0 and (row.gflops, row.mem_bandwidth_gbps) == (50.0, 10.0)
    assert row.to_dict()["tokens_per_s"] > 0


def test_a_gpu_with_too_little_vram_beside_a_ram_node_uses_both_and_never_overfills() -> None:
    # The picture RACoN exists for: a desktop GPU that cannot hold the model, and a RAM box.
    desk = node("d", cpu("d", 2, gflops=200, bw=40), gpu("d", "CUDA0", 3, 20_000, 400))
    box = node("r", cpu("r", 64, gflops=100, bw=20))
    plan = plan_placement(LLAMA_8B, ClusterSnapshot(nodes=(desk, box)), PlacementRequest())
    used = {(d.node_id, d.device) for d in plan.layer_devices}
    assert ("d", "CUDA0") in used and ("r", "CPU") in used
    for d in plan.devices:
        assert d.memory_bytes <= d.free_bytes, d
