"""Slots chosen from memory and one replica per node, in the pure scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from apps.jobs.scheduler import (
    ClusterSnapshot,
    NodeSnapshot,
    PlacementRefused,
    PlacementRequest,
    Plan,
    plan_placement,
)
from apps.jobs.scheduler.reference import exhaustive_best, memory_proportional_plan
from tests.support.scheduler import LLAMA_8B, LLAMA_70B, TINY, check_plan, cluster, cpu, gpu, node

GiB = 1 << 30
KV_8B = LLAMA_8B.kv_bytes_per_token_per_layer  # 4 KiB per token per layer (GQA, f16)


@pytest.fixture(autouse=True)
def _clean_redis() -> Iterator[None]:
    """Pure tests: no Redis."""
    yield


def auto(**kw: object) -> PlacementRequest:
    return PlacementRequest(n_parallel=None, **kw)  # type: ignore[arg-type]


def test_slots_left_open_are_capped_at_max_parallel_when_memory_is_plenty() -> None:
    snap = cluster(node("a", cpu("a", 64)))
    plan = plan_placement(TINY, snap, auto())
    assert plan.n_parallel == 16
    check_plan(plan, TINY, snap)
    assert plan_placement(TINY, snap, auto(max_parallel=5)).n_parallel == 5
    assert any("capped at 16" in line for line in plan.explanation)


def test_slots_left_open_are_as_many_as_the_kv_of_every_slot_allows() -> None:
    # 8B weights ~3.7 GiB; each slot at n_ctx 8192 needs 32 layers x 8192 x 4 KiB = 1 GiB of KV.
    snap = cluster(node("a", cpu("a", 12)))
    plan = plan_placement(LLAMA_8B, snap, auto(n_ctx=8192))
    n = plan.n_parallel
    assert 1 < n < 16
    check_plan(plan, LLAMA_8B, snap)
    cpu_dev = plan.devices[0]
    assert cpu_dev.memory_bytes >= 32 * 8192 * KV_8B * n  # every slot's KV is counted
    # One more slot would not fit: asking for it is refused, naming the limit.
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(LLAMA_8B, snap, PlacementRequest(n_ctx=8192, n_parallel=n + 1))
    assert exc.value.code == "n_parallel_too_large" and exc.value.bad_input
    assert exc.value.limit == n
    assert f"at most {n} slots fit" in exc.value.reason
    # And exactly n, asked for, is the same plan.
    fixed = plan_placement(LLAMA_8B, snap, PlacementRequest(n_ctx=8192, n_parallel=n))
    assert fixed.devices == plan.devices


def test_slots_do_not_move_layers_from_where_one_slot_runs_fastest() -> None:
    snap = cluster(node("a", cpu("a", 16), gpu("a", 0, 3)))
    one = plan_placement(LLAMA_8B, snap, PlacementRequest(n_ctx=4096))
    many = plan_placement(LLAMA_8B, snap, auto(n_ctx=4096))
    assert [(d.device, d.layer_start, d.layer_end) for d in many.devices] == [
        (d.device, d.layer_start, d.layer_end) for d in one.devices
    ]
    assert many.n_parallel >= 1
    check_plan(many, LLAMA_8B, snap)


def test_a_split_plan_holds_every_slot_s_kv_on_every_device() -> None:
    snap = cluster(
        node("a", cpu("a", 24)), node("b", cpu("b", 24)), node("c", cpu("c", 24), gpu("c", 0, 8))
    )
    plan = plan_placement(LLAMA_70B, snap, auto(n_ctx=2048))
    assert len(plan.node_ids) > 1
    check_plan(plan, LLAMA_70B, snap)
    kv = LLAMA_70B.kv_bytes_per_token_per_layer * 2048 * plan.n_parallel
    for d in plan.layer_devices:
        assert d.memory_bytes >= d.n_layers * kv
    # The tightest device binds: one more slot's KV (and logits row) overflows one of them.
    if plan.n_parallel < 16:
        per_slot = LLAMA_70B.kv_bytes_per_token_per_layer * 2048
        logits = LLAMA_70B.n_vocab * 4
        assert any(
            d.memory_bytes + (d.n_layers * per_slot + (logits if i == 0 else 0)) * 1.1
            > d.free_bytes
            for i, d in enumerate(plan.devices)
        )


def test_the_plan_carries_its_slots_and_each_slot_s_context_to_the_agent() -> None:
    snap = cluster(node("a", cpu("a", 64)))
    plan = plan_placement(TINY, snap, auto(n_ctx=1024))
    body = json.loads(json.dumps(plan.to_dict()))
    assert body["n_parallel"] == 16 and body["n_ctx"] == 1024
    assert Plan.from_dict(body) == plan


@pytest.mark.parametrize("n", [0, -3])
def test_zero_or_negative_slots_are_bad_input_that_names_the_limit(n: int) -> None:
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(TINY, cluster(node("a", cpu("a", 8))), PlacementRequest(n_parallel=n))
    assert exc.value.bad_input and exc.value.code == "invalid_request"
    assert f"n_parallel must be at least 1 (got {n})" in exc.value.reason


def test_more_slots_than_memory_allows_names_the_node_the_kv_and_the_limit() -> None:
    snap = cluster(node("box", cpu("box", 12)))
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(LLAMA_8B, snap, PlacementRequest(n_ctx=8192, n_parallel=64))
    reason = exc.value.reason
    assert reason.startswith("n_parallel 64 needs 64.0 GiB of KV on box CPU")
    assert f"at most {exc.value.limit} slots fit" in reason
    assert exc.value.to_dict()["limit"] == exc.value.limit >= 1


def test_a_model_too_big_for_even_one_slot_keeps_the_memory_refusal() -> None:
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(LLAMA_8B, cluster(node("a", cpu("a", 2))), PlacementRequest(n_parallel=4))
    assert exc.value.code == "no_capacity" and not exc.value.bad_input
    assert "more memory" in exc.value.reason


def test_baselines_choose_slots_from_memory_too() -> None:
    snap = cluster(node("a", cpu("a", 64)), node("b", cpu("b", 8)))
    for plan in (
        exhaustive_best(TINY, snap, auto()),
        memory_proportional_plan(TINY, snap, auto()),
    ):
        assert plan.n_parallel == 16
        check_plan(plan, TINY, snap)


# --- one replica per node ---------------------------------------------------------------------


def serving(n: NodeSnapshot) -> NodeSnapshot:
    return NodeSnapshot(**{**n.__dict__, "serves_model": True})


def test_a_node_that_serves_the_model_is_not_given_a_second_replica() -> None:
    a, b = node("a", cpu("a", 64)), node("b", cpu("b", 16))
    plan = plan_placement(TINY, ClusterSnapshot(nodes=(serving(a), b)), auto())
    assert plan.node_ids == ("b",)
    assert any("already serve this model" in line and "a" in line for line in plan.explanation)


def test_allow_same_node_places_another_replica_where_one_runs() -> None:
    a = node("a", cpu("a", 64))
    plan = plan_placement(TINY, ClusterSnapshot(nodes=(serving(a),)), auto(allow_same_node=True))
    assert plan.node_ids == ("a",)


def test_when_every_node_serves_the_model_placement_is_refused_saying_so() -> None:
    snap = ClusterSnapshot(nodes=(serving(node("a", cpu("a", 64))),))
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(TINY, snap, auto())
    assert "no eligible nodes" in exc.value.reason
    assert "already serve this model" in exc.value.reason


def test_pinning_a_node_that_serves_the_model_is_refused_unless_allowed() -> None:
    snap = ClusterSnapshot(nodes=(serving(node("a", cpu("a", 64))), node("b", cpu("b", 64))))
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(TINY, snap, auto(pin_nodes=("a",)))
    assert exc.value.code == "already_served" and "allow_same_node" in exc.value.reason
    plan = plan_placement(TINY, snap, auto(pin_nodes=("a",), allow_same_node=True))
    assert plan.primary_node_id == "a"
