"""Failover of a running job to another replica: the attempt ended, the next one routed and started.

Called by the job's reader (serving.py). A deployment found dead is failed and replaced through
deployments.py (deployment_failed_replace), as a runtime failure report would.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from apps.models_repo.models import Model
from apps.nodes.commands import command_send, job_cancel_clear, job_cancel_flag
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory
from racon import ids
from racon.ids import DeploymentId, JobId, ModelId, NodeId
from racon.redis import get_redis

from . import admission, selectors
from .deployments import deployment_ensure, deployment_failed_replace
from .jobs import DeploymentError, dispatch_node_ids, dispatch_placement, job_run_payload
from .models import Deployment, Job, JobAttempt
from .states import DEPLOYMENT_ACTIVE, JOB_IN_FLIGHT, JOB_TERMINAL

# --- failover (docs/design/serving.md, "Failover") ---------------------------------------------
#
# The job's reader (apps/jobs/streams.py) sees its attempt end because the primary died, vanished
# or went silent. job_failover_begin records that attempt's end and stops routing to a dead
# deployment; the reader then takes a slot on another serving replica (serving.py) and
# job_failover_dispatch starts the next attempt there, resuming from the token ids relayed so far.


def job_failover_begin(
    *,
    job_id: JobId,
    deployment_id: DeploymentId,
    node_id: NodeId,
    attempt: int,
    cause: str,
    message: str,
    chunks: int,
    completion_tokens: int,
    wait_seconds: float,
    now: datetime,
) -> bool:
    """End attempt ``attempt`` (``chunks``/``completion_tokens``: the reader's counts of it).

    The job's JobAttempt rows start here (the first from the job itself). A deployment whose
    primary died or was lost is FAILED at once (routing skips it, a replacement is placed), as a
    runtime failure report would; the old primary is told to stop in case it still runs. False
    when the job is no longer open (cancelled meanwhile): there is nothing to fail over.
    """
    job = Job.objects.filter(pk=job_id).select_related("deployment").first()
    if job is None or job.state in JOB_TERMINAL:
        return False
    admission.failover_begin(job_id=job_id, seconds=wait_seconds + 60)
    job_cancel_flag(job_id=ids.job_id(job_id), node_id=ids.node_id(node_id))
    dep = job.deployment
    with transaction.atomic():
        if attempt == 1 and not JobAttempt.objects.filter(job_id=job_id).exists():
            JobAttempt.objects.create(
                job_id=job_id,
                number=1,
                deployment=dep,
                primary_id=node_id,
                plan=(dep.plan if dep is not None else {}) or {},
                started_at=job.dispatched_at or job.queued_at,
            )
        JobAttempt.objects.filter(job_id=job_id, number=attempt, ended_at__isnull=True).update(
            ended_at=now,
            outcome=cause.upper(),
            error=message[:2000],
            completion_tokens=completion_tokens,
            chunks=chunks,
        )
    if cause in ("primary_died", "primary_lost", "deployment_not_loaded") and dep is not None:
        # Before the slot is given back: no waiter may take it on a dead deployment.
        deployment_failed_replace(
            dep=dep, node_id=node_id, message=f"job {job_id}: {message}", now=now
        )
    admission.slot_release(deployment_id=deployment_id, job_id=job_id)
    return True


def job_failover_left(*, job_id: JobId, tokens_so_far: int) -> int:
    """Completion tokens the next attempt may still produce."""
    max_tokens = Job.objects.filter(pk=job_id).values_list("max_tokens", flat=True).first() or 0
    return int(max_tokens) - int(tokens_so_far)


def job_failover_dispatch(
    *,
    job_id: JobId,
    deployment: Deployment,
    attempt: int,
    resume_tokens: list[int],
    from_deployment_id: DeploymentId,
    from_node_id: NodeId,
    cause: str,
    now: datetime,
    id_slot: int | None = None,
) -> dict[str, Any]:
    """Start attempt ``attempt`` on ``deployment`` (the caller holds a slot there): run_job with
    the token ids so far as ``resume_tokens`` and what is left of max_tokens, the job moved to
    the new plan, its JobAttempt row and the JOB_FAILOVER event. DeploymentError (slot given back)
    when the job ended meanwhile."""
    try:
        deployment = Deployment.objects.get(
            pk=deployment.pk
        )  # placed while the caller waited: its primary now
        if deployment.primary_id is None:  # a command to no node would sit in a "None" queue
            raise DeploymentError(f"deployment {deployment.id} has no primary")
        job = Job.objects.only("id", "kind", "max_tokens", "params", "state").get(pk=job_id)
        left = int(job.max_tokens) - len(resume_tokens)
        if job.state in JOB_TERMINAL or left <= 0:
            raise DeploymentError("job is no longer open")
        payload = job_run_payload(
            job_id=ids.job_id(job.id),
            deployment_id=ids.deployment_id(deployment.id),
            kind=job.kind,
            max_tokens=left,
            params=job.params,
            id_slot=id_slot,  # the llama-server slot the KV coordinator pinned it to
            attempt=attempt,
            resume_tokens=list(resume_tokens),
        )
        # An earlier attempt's failover on this same node set its cancel key (job_failover_begin):
        # left there, it would cancel this attempt as soon as the primary saw it (found by the
        # reliability suite: "The request was cancelled." after a failover back to a node).
        job_cancel_clear(job_id=ids.job_id(job.id), node_id=ids.node_id(deployment.primary_id))
        command_send(node_id=ids.node_id(deployment.primary_id), kind="run_job", payload=payload)
        plan = deployment.plan or {}
        placement = dispatch_placement(deployment)
        node_ids = dispatch_node_ids(deployment)
        with transaction.atomic():
            moved = Job.objects.filter(pk=job_id, state__in=JOB_IN_FLIGHT).update(
                deployment_id=deployment.id,
                placement={"devices": placement, "primary": plan.get("primary_node_id")},
            )
            if not moved:
                raise DeploymentError("job is no longer open")
            job.nodes.add(*node_ids)  # type: ignore[arg-type]  # pks; the stubs take only int pks
            JobAttempt.objects.create(
                job_id=job_id,
                number=attempt,
                deployment=deployment,
                primary_id=deployment.primary_id,
                plan=plan,
                started_at=now,
            )
            event_record(
                kind="JOB_FAILOVER",
                category=EventCategory.EXECUTION,
                now=now,
                job_id=job_id,
                deployment_id=ids.deployment_id(deployment.id),
                node_id=ids.node_id(deployment.primary_id),
                message=(
                    f"attempt {attempt}: {cause} on deployment {from_deployment_id}; "
                    f"continues on {deployment.id} after {len(resume_tokens)} tokens"
                ),
                data={
                    "from_deployment": str(from_deployment_id),
                    "to_deployment": str(deployment.id),
                    "from_node": str(from_node_id),
                    "to_node": str(deployment.primary_id),
                    "attempt": attempt,
                    "tokens_so_far": len(resume_tokens),
                    "cause": cause,
                },
            )
    except BaseException:
        if deployment.primary_id is not None:
            job_cancel_flag(job_id=ids.job_id(job_id), node_id=ids.node_id(deployment.primary_id))
        admission.slot_release(deployment_id=ids.deployment_id(deployment.id), job_id=job_id)
        raise
    finally:
        admission.failover_end(job_id=job_id)
    return {
        "nodes": node_ids,
        "primary": str(deployment.primary_id),
        "n_parallel": deployment.n_parallel,
    }


def failover_engine_excludes(*, job_id: JobId, model_id: ModelId) -> set[str]:
    """The model's replicas a job cannot resume on: a schema-constrained output (``json_schema``:
    a response_format's or a forced tool call's) cannot resume on vLLM, whose structured output
    starts at the first token (agent/runtime/vllm.py), so it goes to a llama.cpp replica."""
    params = Job.objects.filter(pk=job_id).values_list("params", flat=True).first() or {}
    if not isinstance(params, dict) or params.get("json_schema") is None:
        return set()
    return {
        str(pk)
        for pk in Deployment.objects.filter(model_id=model_id, engine="vllm").values_list(
            "pk", flat=True
        )
    }


def job_failover_route(
    *, model_id: ModelId, exclude: Collection[Any], now: datetime
) -> Deployment | None:
    """Where a failed-over job can go: the best serving replica but those excluded, else the
    model's active deployment (a replacement being placed; one is created when there is none)."""
    dep = selectors.deployment_route(model_id=model_id, exclude=exclude)
    if dep is not None:
        return Deployment.objects.get(pk=dep.pk)
    excluded = {str(e) for e in exclude}
    # Waiters poll this every second: at most one automatic placement per model per
    # FAILOVER_ENSURE_BACKOFF_SECONDS, so a placement that fails at once (no capacity) is not
    # retried in a loop that floods the model with FAILED deployments.
    if not get_redis().set(
        f"racon:model:{model_id}:failover-ensure",
        1,
        nx=True,
        ex=int(settings.FAILOVER_ENSURE_BACKOFF_SECONDS),
    ):
        pending = (
            Deployment.objects.filter(model_id=model_id, state__in=list(DEPLOYMENT_ACTIVE))
            .exclude(pk__in=list(excluded))
            .order_by("-created_at")
            .first()
        )
        return pending
    model = Model.objects.get(pk=model_id)
    ensured = deployment_ensure(model=model, now=now)
    return None if str(ensured.id) in excluded else ensured
