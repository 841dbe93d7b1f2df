"""Factories and helpers for credits tests: models, deployments with plans, jobs, funded accounts."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime, timedelta
from typing import Any

import factory
from django.utils import timezone
from factory.django import DjangoModelFactory

from apps.accounts.models import Account
from apps.credits.ledger import credit_grant
from apps.jobs.models import Deployment, Job
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model, ModelFile
from apps.nodes.models import Node
from tests.factories import AccountFactory


class ModelFactory(DjangoModelFactory):
    class Meta:
        model = Model

    name = factory.Sequence(lambda n: f"model-{n}")
    price_weight_permille = 1000


class ModelFileFactory(DjangoModelFactory):
    class Meta:
        model = ModelFile

    model = factory.SubFactory(ModelFactory)
    file_name = factory.Sequence(lambda n: f"model-{n}.gguf")
    sha256 = factory.LazyFunction(lambda: hashlib.sha256(uuid.uuid4().bytes).hexdigest())
    size = 1024**3
    n_layer = 32


def plan_for(layers: list[tuple[Node, int]], *, primary: Node | None = None) -> dict[str, Any]:
    """A Plan.to_dict()-shaped plan: nodes in order, each holding the given number of layers."""
    devices = []
    start = 0
    primary = primary or layers[0][0]
    for node, n in layers:
        devices.append(
            {
                "node_id": str(node.pk),
                "device": "CPU",
                "kind": "cpu",
                "layer_start": start,
                "layer_end": start + n,
                "n_layers": n,
                "memory_bytes": n * 100_000_000,
                "endpoint": None if node.pk == primary.pk else f"{node.address}:50052",
            }
        )
        start += n
    return {"primary_node_id": str(primary.pk), "devices": devices}


def deployment_for(
    layers: list[tuple[Node, int]], *, model: Model | None = None, primary: Node | None = None
) -> Deployment:
    model = model or ModelFactory()
    mf = ModelFileFactory(model=model)
    primary = primary or layers[0][0]
    dep = Deployment.objects.create(
        model=model,
        model_file=mf,
        state=DeploymentState.READY,
        primary=primary,
        plan=plan_for(layers, primary=primary),
    )
    dep.nodes.set([n for n, _ in layers])
    return dep


def job_for(
    *,
    account: Account | None,
    model: Model,
    deployment: Deployment | None = None,
    max_tokens: int = 100,
    queued_at: datetime | None = None,
) -> Job:
    return Job.objects.create(
        model=model,
        deployment=deployment,
        account=account,
        max_tokens=max_tokens,
        queued_at=queued_at or timezone.now(),
        state=JobState.QUEUED,
    )


def job_finish(
    job: Job,
    *,
    state: str = JobState.COMPLETED,
    prompt: int = 0,
    completion: int = 0,
    device_seconds: dict[str, float] | None = None,
) -> Job:
    """Move a job to a terminal state with usage, as the jobs app does before settlement.

    With device_seconds, the job was dispatched that long before it finished (settlement bounds
    each device's figure by the attempt's wall time as the controller saw it)."""
    now = timezone.now()
    longest = max((float(v) for v in (device_seconds or {}).values()), default=0.0)
    dispatched = now - timedelta(seconds=max(longest, 0.0) + 1.0)
    Job.objects.filter(pk=job.pk).update(
        state=state,
        prompt_tokens=prompt,
        completion_tokens=completion,
        device_seconds=device_seconds or {},
        dispatched_at=dispatched,
        queued_at=min(job.queued_at, dispatched),
        finished_at=now,
    )
    job.refresh_from_db()
    return job


def funded_account(amount: int, **kw: Any) -> Account:
    acct = AccountFactory(**kw)
    if amount:
        credit_grant(account_id=acct.pk, amount=amount, reason="test funds", now=timezone.now())
    acct.refresh_from_db()
    return acct
