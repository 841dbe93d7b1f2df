"""Rows and captures for the observability tests: deployments and jobs in given states, what the
live run left behind (LiveRun), and a diagnostic bundle's files."""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from apps.jobs.models import Deployment, Job
from apps.models_repo.models import ModelFile
from tests.factories import DeploymentFactory, JobFactory


def make_deployment(
    model_file: ModelFile,
    *,
    state: str = "READY",
    primary: Any = None,
    nodes: list[Any] | None = None,
) -> Deployment:
    """A deployment of ``model_file`` in ``state`` (no primary unless given)."""
    dep = DeploymentFactory(
        model=model_file.model, model_file=model_file, state=state, primary=primary
    )
    if nodes:
        dep.nodes.set(nodes)
    return dep


def make_job(
    model_file: ModelFile,
    *,
    state: str = "QUEUED",
    now: datetime,
    deployment: Deployment | None = None,
    nodes: list[Any] | None = None,
    **fields: Any,
) -> Job:
    """A job of ``model_file``'s model in ``state``, queued at ``now`` unless given."""
    job = JobFactory(
        model=model_file.model,
        state=state,
        deployment=deployment,
        queued_at=fields.pop("queued_at", now),
        max_tokens=fields.pop("max_tokens", 256),
        **fields,
    )
    if nodes:
        job.nodes.set(nodes)
    return job


@dataclass
class LiveRun:
    """What one real request through the real controller and agent left behind."""

    job_id: str
    request_id: str
    node_id: str
    deployment_id: str
    model: str
    completion_tokens: int
    charged: int
    starting_grant: int
    metrics_before_drain: str
    metrics_after_drain: str
    unauthorized_status: int
    wrong_token_status: int
    agent_metrics: str
    controller_log: str
    agent_log: str
    bundle: bytes
    doctor_bundle: bytes
    node_secrets: list[str]
    timings: dict[str, float] = field(default_factory=dict)


def unpack(data: bytes) -> dict[str, bytes]:
    """A bundle's files by their name inside its top folder."""
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            fh = tar.extractfile(member)
            if fh is not None:
                out[member.name.split("/", 1)[1]] = fh.read()
    return out
