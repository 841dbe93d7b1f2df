from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.nodes.heartbeats import heartbeat_target
from apps.nodes.models import Event, Node
from apps.nodes.services import BUSY_FLIPS_KEY, node_transition
from apps.nodes.states import TRANSITIONS, NodeState, can_transition, health_state
from racon import ids
from racon.redis import get_redis
from tests.factories import NodeFactory

S = NodeState


def test_every_state_has_a_row_in_the_transition_table() -> None:
    assert set(TRANSITIONS) == set(NodeState.values)
    for targets in TRANSITIONS.values():
        assert targets <= set(NodeState.values)


def test_error_is_left_only_by_a_new_handshake() -> None:
    assert not can_transition(S.ERROR, S.READY)
    assert can_transition(S.ERROR, S.REGISTERING)


@pytest.mark.parametrize(
    ("age", "expected"),
    [(0, None), (14.9, None), (15, S.DEGRADED), (44.9, S.DEGRADED), (45, S.OFFLINE)],
)
def test_health_state_applies_interval_multiples(age: float, expected: str | None) -> None:
    assert health_state(age=age, interval=5, degraded_after=3, offline_after=9) == expected


def test_heartbeat_from_registering_node_waits_for_runtime_checks() -> None:
    assert (
        heartbeat_target(current=S.REGISTERING, wanted=None, busy=False, drain_requested=False)
        is None
    )
    assert (
        heartbeat_target(current=S.REGISTERING, wanted=S.READY, busy=False, drain_requested=False)
        == S.READY
    )


def test_heartbeat_after_offline_returns_node_to_ready_or_draining() -> None:
    assert (
        heartbeat_target(current=S.OFFLINE, wanted=S.READY, busy=False, drain_requested=False)
        == S.READY
    )
    assert (
        heartbeat_target(current=S.OFFLINE, wanted=S.READY, busy=False, drain_requested=True)
        == S.DRAINING
    )


@pytest.mark.django_db
def test_illegal_transition_is_refused_and_writes_no_event(now) -> None:  # type: ignore[no-untyped-def]
    node = NodeFactory(state=S.ERROR)
    assert node_transition(node_id=ids.node_id(node.id), to=S.READY, now=now) is False
    node.refresh_from_db()
    assert node.state == S.ERROR
    assert not Event.objects.filter(node=node).exists()


@pytest.mark.django_db
def test_stale_message_cannot_move_state_backwards(now) -> None:  # type: ignore[no-untyped-def]
    node = NodeFactory(state=S.READY)
    assert node_transition(node_id=ids.node_id(node.id), to=S.OFFLINE, expected=S.READY, now=now)
    # A late message that still believes the node is READY must not apply.
    assert not node_transition(
        node_id=ids.node_id(node.id),
        to=S.DEGRADED,
        expected=S.READY,
        now=now + timedelta(seconds=1),
    )
    node.refresh_from_db()
    assert node.state == S.OFFLINE
    assert Event.objects.filter(node=node).count() == 1


@pytest.mark.django_db
@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.sampled_from(NodeState.values), min_size=1, max_size=15))
def test_random_transition_sequences_follow_the_table_and_log_every_move(steps: list[str]) -> None:
    """Every move writes its event, except BUSY ⇄ READY, which is counted (issue 28)."""
    from django.utils import timezone

    node = NodeFactory(state=S.UNINITIALIZED)
    state: str = S.UNINITIALIZED
    moves = flips = 0
    flips_before = int(get_redis().get(BUSY_FLIPS_KEY) or 0)
    for target in steps:
        moved = node_transition(node_id=ids.node_id(node.id), to=target, now=timezone.now())
        assert moved == (target != state and can_transition(state, target))
        if moved:
            if {state, target} == {S.BUSY, S.READY}:
                flips += 1
            else:
                moves += 1
            state = target
        assert Node.objects.get(pk=node.id).state == state
    assert Event.objects.filter(node=node).count() == moves
    assert int(get_redis().get(BUSY_FLIPS_KEY) or 0) - flips_before == flips
