"""The operator's pinned primary (`"primary"` in a deployment request): a split over two nodes
runs its llama-server where the operator says, either way round (issue 24: each node of a split
over make run's own node and a joined host is the primary once)."""

from __future__ import annotations

import pytest

from apps.jobs.scheduler import (
    ClusterSnapshot,
    PlacementRefused,
    PlacementRequest,
    plan_placement,
)
from tests.support.scheduler_devices import TINY, cpu, gpu, node


def _pair() -> ClusterSnapshot:
    # b is faster: left to itself the scheduler makes b the primary.
    return ClusterSnapshot(
        nodes=(node("a", cpu("a", 16, gflops=50)), node("b", cpu("b", 16, gflops=400)))
    )


@pytest.mark.parametrize("primary", ["a", "b"])
def test_a_spread_split_runs_its_primary_on_the_pinned_node(primary: str) -> None:
    req = PlacementRequest(pin_nodes=("a", "b"), spread=True, primary=primary)
    plan = plan_placement(TINY, _pair(), req)
    assert plan.primary_node_id == primary
    assert set(plan.node_ids) == {"a", "b"}


def test_an_unverified_gpu_node_may_be_the_pinned_primary() -> None:
    snap = ClusterSnapshot(
        nodes=(
            node("a", cpu("a", 16)),
            node("g", cpu("g", 16), gpu("g", "Vulkan0", 2, 2.0, 0.5), may_be_primary=False),
        )
    )
    free = plan_placement(TINY, snap, PlacementRequest(pin_nodes=("a", "g"), spread=True))
    assert free.primary_node_id == "a"
    pinned = plan_placement(
        TINY, snap, PlacementRequest(pin_nodes=("a", "g"), spread=True, primary="g")
    )
    assert pinned.primary_node_id == "g"


@pytest.mark.parametrize(
    ("req", "said"),
    [
        (PlacementRequest(pin_nodes=("a",), primary="b"), "not one of the pinned nodes"),
        (PlacementRequest(exclude_nodes=("b",), primary="b"), "also excluded"),
        (PlacementRequest(primary="zz"), "unknown primary node"),
    ],
)
def test_a_primary_outside_the_request_is_refused_naming_why(
    req: PlacementRequest, said: str
) -> None:
    with pytest.raises(PlacementRefused) as exc:
        plan_placement(TINY, _pair(), req)
    assert said in exc.value.reason
