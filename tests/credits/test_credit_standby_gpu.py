"""An unverified GPU is credited at the floor until a challenge passes (issue 25 item 4): the
standby reward pays for its VRAM only once apps/nodes/gpu_challenges.py verified it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from apps.accounts.models import Account
from apps.credits.models import Entry, EntryKind
from apps.credits.settlement import credit_standby_reward
from apps.nodes.models import Node
from tests.factories import NodeFactory, hardware_profile

pytestmark = pytest.mark.django_db
GIB = 1024**3


@pytest.fixture
def standby(settings: Any) -> Any:
    settings.CREDITS_STANDBY_PER_GIB_HOUR = 1_000
    settings.CREDITS_STANDBY_PERIOD_SECONDS = 600
    settings.CREDITS_ESCROW_ENABLED = False
    settings.CREDITS_STANDBY_UNSEEN_BYTES = -1
    settings.CREDITS_STANDBY_CAP_PER_PERIOD = 0
    return settings


def gpu(**over: Any) -> dict[str, Any]:
    return {
        "index": 0, "vendor": "nvidia", "name": "H100 (claimed)", "uuid": "GPU-1",
        "vram_total": 80 * GIB, "vram_free": 80 * GIB, "driver": "x", "device": "CUDA0",
        "backend": "CUDA", "gflops": 900_000.0, **over,
    }  # fmt: skip


def test_an_unverified_gpus_vram_earns_no_standby_until_its_challenge_passes(
    standby: Any, now: Any
) -> None:
    claims: Node = NodeFactory(
        hardware=hardware_profile(gpus=[gpu()]),
        ram_available=8 * GIB,
        vram_free=80 * GIB,
        state_changed_at=now - timedelta(hours=2),
    )
    verified: Node = NodeFactory(
        hardware=hardware_profile(gpus=[gpu(verified_gflops=50_000.0)]),
        ram_available=8 * GIB,
        vram_free=80 * GIB,
        state_changed_at=now - timedelta(hours=2),
    )
    credit_standby_reward(now=now)
    # One period (10 min) at 1000 µ/GiB·h: 8 GiB for the claim alone, 88 GiB once verified.
    assert Account.objects.get(pk=claims.account_id).balance == 8 * 1_000 // 6
    assert Account.objects.get(pk=verified.account_id).balance == 88 * 1_000 // 6
    entry = Entry.objects.get(kind=EntryKind.STANDBY, node=claims)
    assert entry.data["unverified_gpu_bytes"] == 80 * GIB
