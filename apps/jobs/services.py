"""Writes for deployments and jobs."""

from __future__ import annotations

from datetime import datetime
from typing import Any


def deployments_on_node_state(*, node_id: str, state: str, now: datetime) -> None:
    """A member node changed health: degrade, fail or re-plan the deployments it serves."""
    return None
