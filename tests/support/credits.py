"""Jobs holding credits, for the settlement tests (the sweep's and the batch's)."""

from __future__ import annotations

from typing import Any

from apps.credits.models import Entry, EntryKind
from apps.credits.settlement import credit_reserve
from apps.jobs.states import JobState
from racon import ids
from tests.factories import (
    AccountFactory,
    ModelFactory,
    NodeFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)


def held_job(*, state: str | None = JobState.COMPLETED, completion: int = 30) -> Any:
    """A job with a 100-token hold; finished (with usage) unless ``state`` is None."""
    owner = AccountFactory()
    node = NodeFactory(account=owner)
    model = ModelFactory(price_weight_permille=1000)
    dep = deployment_for([(node, 8)], model=model)
    consumer = funded_account(1_000_000)
    job = job_for(account=consumer, model=model, deployment=dep, max_tokens=100)
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=100,
        model_price_permille=1000,
        now=job.queued_at,
    )
    if state is not None:
        job_finish(job, state=state, prompt=10, completion=completion)
    return job, consumer, owner


def settles(job: Any) -> int:
    return Entry.objects.filter(kind=EntryKind.SETTLE, job_id=job.pk).count()
