"""Writes for the model repository (registration, replicas, distribution)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction

from .models import ModelFile, Replica


def replicas_sync(*, node_id: Any, files: list[dict[str, Any]], now: datetime) -> int:
    """Record which registered files a node holds (matched by sha256); drop ones it no longer has."""
    by_sha = {f["sha256"]: f for f in files if isinstance(f, dict) and f.get("sha256")}
    known = {mf.sha256: mf for mf in ModelFile.objects.filter(sha256__in=list(by_sha))}
    with transaction.atomic():
        Replica.objects.filter(node_id=node_id).exclude(model_file__sha256__in=list(known)).delete()
        for sha, mf in known.items():
            Replica.objects.update_or_create(
                node_id=node_id, model_file=mf, defaults={"path": by_sha[sha]["path"], "verified_at": now}
            )
    return len(known)
