"""Small after-commit broadcasts to Channels groups (the live UI)."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger("racon.broadcast")


def broadcast(group: str, message: dict[str, Any]) -> None:
    """Send to a group; a broadcast failure must never fail the write that caused it."""
    try:
        layer = get_channel_layer()
        if layer is None:
            return
        async_to_sync(layer.group_send)(group, message)
    except Exception:  # best effort by design
        log.warning("broadcast to %s failed", group, exc_info=True)
