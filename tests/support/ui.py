"""The web UI tests' shared shapes: the htmx request header and the two-account world."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apps.credits.models import Receipt
from apps.jobs.models import Deployment, Job
from apps.nodes.models import Node

HTMX: dict[str, Any] = {"HTTP_HX_REQUEST": "true"}


@dataclass
class World:
    """Two accounts: an operator (staff) and a contributor, each with a node, a job and a receipt."""

    staff: Any
    contributor: Any
    staff_node: Node
    own_node: Node
    deployment: Deployment
    staff_job: Job
    own_job: Job
    staff_receipt: Receipt
    own_receipt: Receipt
