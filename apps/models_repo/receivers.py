"""What models_repo listens to, connected once from ``ModelsRepoConfig.ready``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from apps.nodes import hooks as node_hooks
from racon.ids import NodeId

from .services import replicas_sync


def _node_models_reported(
    *, node_id: NodeId, files: list[dict[str, Any]], now: datetime, **kwargs: Any
) -> None:
    """An agent's handshake listed the model files it holds: they are its replicas now."""
    replicas_sync(node_id=node_id, files=files, now=now)


def connect() -> None:
    node_hooks.node_models_reported.connect(
        _node_models_reported, dispatch_uid="racon-models-repo-node-models"
    )
