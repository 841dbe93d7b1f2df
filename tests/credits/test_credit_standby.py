from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from apps.accounts.models import Account
from apps.credits.ledger import ledger_verify
from apps.credits.models import Entry, EntryKind
from apps.credits.settlement import credit_standby_reward
from apps.credits.tasks import standby_reward
from apps.nodes.states import NodeState
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db
GIB = 1024**3


@pytest.fixture
def standby(settings: Any) -> Any:
    settings.CREDITS_STANDBY_PER_GIB_HOUR = 1_000
    settings.CREDITS_STANDBY_PERIOD_SECONDS = 600
    settings.CREDITS_ESCROW_ENABLED = False
    # These tests pin the rate × memory × time rule; the caps on claims have tests of their own.
    settings.CREDITS_STANDBY_UNSEEN_BYTES = -1
    settings.CREDITS_STANDBY_CAP_PER_PERIOD = 0
    return settings


def bal(acct: Account) -> int:
    return Account.objects.get(pk=acct.pk).balance


def test_ready_nodes_are_paid_for_memory_offered_times_time_lent(standby: Any, now: Any) -> None:
    ready = NodeFactory(
        ram_available=8 * GIB, vram_free=4 * GIB, state_changed_at=now - timedelta(hours=2)
    )
    busy = NodeFactory(state=NodeState.BUSY, state_changed_at=now - timedelta(hours=2))
    offline = NodeFactory(state=NodeState.OFFLINE, state_changed_at=now - timedelta(hours=2))
    paid = credit_standby_reward(now=now)
    assert len(paid) == 1
    # 12 GiB × 1000 µ/GiB·h × 10 minutes (one period at most, since it was READY for longer)
    assert bal(ready.account) == 2_000
    assert bal(busy.account) == 0 and bal(offline.account) == 0
    assert paid[0].node_id == ready.pk and paid[0].kind == EntryKind.STANDBY


def test_standby_is_paid_once_per_node_per_period(standby: Any, now: Any) -> None:
    period_start = now.replace(minute=(now.minute // 10) * 10, second=0, microsecond=0)
    node = NodeFactory(
        ram_available=6 * GIB, vram_free=0, state_changed_at=period_start - timedelta(hours=1)
    )
    t = period_start + timedelta(minutes=1)
    credit_standby_reward(now=t)
    credit_standby_reward(now=t + timedelta(minutes=5))  # same period: nothing more
    assert Entry.objects.filter(kind=EntryKind.STANDBY).count() == 1
    first = bal(node.account)
    assert first == 6 * 1_000 * 10 // 60  # a full period (10 min) back: 1_000
    credit_standby_reward(
        now=t + timedelta(minutes=10)
    )  # next period: exactly the 10 minutes since
    assert bal(node.account) == first + 1_000
    assert ledger_verify().ok


def test_a_node_that_just_became_ready_is_paid_only_since_then(standby: Any, now: Any) -> None:
    node = NodeFactory(
        ram_available=60 * GIB, vram_free=0, state_changed_at=now - timedelta(minutes=1)
    )
    credit_standby_reward(now=now)
    assert bal(node.account) == 60 * 1_000 // 60  # 60 GiB for one minute


def test_standby_earnings_go_to_escrow_for_new_contributors(standby: Any, now: Any) -> None:
    standby.CREDITS_ESCROW_ENABLED = True
    standby.CREDITS_ESCROW_TRUST_THRESHOLD = 10**9
    node = NodeFactory(
        ram_available=6 * GIB, vram_free=0, state_changed_at=now - timedelta(hours=1)
    )
    credit_standby_reward(now=now)
    assert bal(node.account) == 0
    assert Account.objects.get(name="system:escrow").balance == 1_000


def test_the_beat_task_runs_the_reward(standby: Any, now: Any) -> None:
    NodeFactory(ram_available=6 * GIB, state_changed_at=now - timedelta(hours=1))
    assert standby_reward.delay().result == 1


# --- claims are capped (issue 12) -----------------------------------------------------------------


def test_a_node_claiming_nine_exabytes_is_paid_at_most_the_cap_per_period(
    standby: Any, now: Any
) -> None:
    standby.CREDITS_STANDBY_CAP_PER_PERIOD = 5_000
    node = NodeFactory(
        ram_available=9 * 10**18, vram_free=0, state_changed_at=now - timedelta(hours=1)
    )
    paid = credit_standby_reward(now=now)
    assert bal(node.account) == 5_000
    assert paid[0].data["uncapped"] > 10**9 and paid[0].data["claimed_bytes"] == 9 * 10**18
    assert ledger_verify().ok


def test_memory_never_seen_in_use_is_paid_only_up_to_the_unseen_allowance(
    standby: Any, now: Any
) -> None:
    standby.CREDITS_STANDBY_UNSEEN_BYTES = 6 * GIB
    node = NodeFactory(
        ram_available=60 * GIB, vram_free=0, state_changed_at=now - timedelta(hours=1)
    )
    credit_standby_reward(now=now)
    assert bal(node.account) == 1_000  # 6 GiB for 10 minutes, not 60


def test_memory_another_nodes_primary_loaded_onto_the_worker_is_paid(
    standby: Any, now: Any
) -> None:
    from tests.factories import deployment_for

    standby.CREDITS_STANDBY_UNSEEN_BYTES = 6 * GIB
    primary = NodeFactory(state=NodeState.BUSY)
    worker = NodeFactory(
        address="10.0.0.9",
        ram_available=60 * GIB,
        vram_free=0,
        state_changed_at=now - timedelta(hours=1),
    )
    dep = deployment_for([(worker, 16), (primary, 16)], primary=primary)
    dep.load_report = {
        "assignment": [
            {
                "device": "RPC0",
                "endpoint": "10.0.0.9:50052",
                "model_buffer_mib": 30 * 1024,
                "kv_buffer_mib": 6 * 1024,
            },
            # The primary's own buffers vouch for nothing.
            {"device": "CPU", "endpoint": None, "model_buffer_mib": 500 * 1024},
        ]
    }
    dep.save(update_fields=["load_report"])
    paid = credit_standby_reward(now=now)
    entry = next(e for e in paid if e.node_id == worker.pk)
    assert entry.data["seen_bytes"] == 36 * GIB
    assert bal(worker.account) == 36 * 1_000 * 10 // 60  # 36 GiB seen, for 10 minutes
