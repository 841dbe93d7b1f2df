from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _receipt_key(settings: Any, tmp_path: Path) -> None:
    """Each test signs with its own key file, never the developer's var/ key."""
    settings.RACON_RECEIPT_KEY = ""
    settings.CREDITS_RECEIPT_KEY_PATH = tmp_path / "receipt-signing.key"


@pytest.fixture
def price(settings: Any) -> Any:
    """Round, easy prices: 1000 µ per token at weight 1000, 10% primary bonus, no fee, no escrow."""
    settings.CREDITS_MICRO_PER_TOKEN = 1_000
    settings.CREDITS_PRIMARY_SHARE_PERMILLE = 100
    settings.CREDITS_FEE_PERMILLE = 0
    settings.CREDITS_ESCROW_ENABLED = False
    return settings
