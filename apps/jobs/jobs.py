"""Writes for a job's life: create, dispatch to its primary, mark running, finish (complete,
fail, cancel) from the view or the primary's report, and the stale-job sweep.

A deployment's life is deployments.py (which imports from here, never the reverse); placement
and loading are placement.py, a node's drain drain.py, a job's failover failover.py.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any, cast

from django.db import transaction
from django.db.models import Q, QuerySet, Sum

from agent.protocol import RunJobPayload
from apps.models_repo.models import Model
from apps.nodes.commands import command_send, job_cancel_flag
from apps.nodes.errors import ReportRefused
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory, Node
from apps.nodes.services import node_drain_advance
from apps.nodes.states import NodeState
from racon import ids
from racon.ids import AccountId, ApiKeyId, DeploymentId, JobId, NodeId
from racon.transitions import transition_guarded

from . import admission, hooks, retention, selectors, settle_queue, streams
from .models import Deployment, Job, JobAttempt
from .states import (
    JOB_IN_FLIGHT,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    JobState,
)

log = logging.getLogger("racon.jobs")
J = JobState


class DeploymentError(Exception):
    """A deployment step failed; the message is meant for the operator."""


def _uuid_or_refuse(value: Any, *, what: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ValueError(f"{what} {str(value)[:80]!r} is not a UUID") from None


def job_primary_check(*, job_id: JobId, node_id: NodeId) -> uuid.UUID:
    """The job's id, if the node is the primary of its plan (the one that runs it); ReportRefused if not."""
    return _job_primary_row(job_id=job_id, node_id=node_id)[0]


def _job_primary_row(*, job_id: JobId, node_id: NodeId) -> tuple[uuid.UUID, dict[str, Any]]:
    """job_primary_check, and the job's state, kind, params and deployment (one read)."""
    job_uuid = _uuid_or_refuse(job_id, what="job_id")
    job = (
        Job.objects.filter(pk=job_uuid)
        .values("placement", "deployment__primary_id", "state", "kind", "params", "deployment_id")
        .first()
    )
    if job is None:
        raise ValueError(f"unknown job {job_uuid}")
    primaries = {
        str(p)
        for p in (job["deployment__primary_id"], (job["placement"] or {}).get("primary"))
        if p
    }
    if str(node_id) not in primaries:
        # After a failover, each attempt's primary may still report on its own attempt (stale:
        # ignored); only then are the attempts read.
        primaries |= {
            str(p)
            for p in JobAttempt.objects.filter(job_id=job_uuid).values_list("primary_id", flat=True)
            if p
        }
    if str(node_id) not in primaries:
        raise ReportRefused(
            f"node {node_id} is not the primary of job {job_uuid}'s plan", code="not_plan_member"
        )
    return job_uuid, dict(job)


def drains_advance(*, deployments: QuerySet[Deployment], now: datetime) -> None:
    """Advance the drain of every draining node that is a member of these deployments."""
    if not Node.objects.filter(state=NodeState.DRAINING).exists():
        return  # every job's end asks: a one-table look first, the join only during a drain
    node_ids = set(
        Node.objects.filter(
            Q(deployments__in=deployments) | Q(primary_of__in=deployments), state=NodeState.DRAINING
        ).values_list("id", flat=True)
    )
    for node_id in node_ids:
        node_drain_advance(node_id=ids.node_id(node_id), now=now)


# --- jobs ---------------------------------------------------------------------------------------


def job_transition(
    *,
    job_id: JobId,
    to: str,
    now: datetime,
    expected: str | Collection[str] | None = None,
    fields: dict[str, Any] | None = None,
    kind: str | None = None,
    message: str = "",
    data: dict[str, Any] | None = None,
) -> bool:
    """Guarded move of a job's state (racon.transitions); writes its event when ``kind`` names one.

    Terminal states are final.
    """

    def record(src: str) -> None:
        event_record(
            kind=kind or "",
            category=EventCategory.EXECUTION,
            now=now,
            job_id=job_id,
            deployment_id=(fields or {}).get("deployment_id"),
            old_state=src,
            new_state=to,
            message=message,
            data=data,
        )

    moved = transition_guarded(
        model=Job,
        pk=job_id,
        to=to,
        table=JOB_TRANSITIONS,
        expected=expected,
        fields=fields,
        record=record if kind else None,
    )
    return moved is not None


def job_create(
    *,
    model: Model,
    account_id: AccountId | None,
    api_key_id: ApiKeyId | None,
    kind: str,
    params: dict[str, Any],
    max_tokens: int,
    stream: bool,
    request_id: str,
    now: datetime,
    job_id: JobId | None = None,
    dispatched_to: Deployment | None = None,
    hold: Callable[[Job], None] | None = None,
) -> Job:
    """Record a QUEUED job and its credit hold (what ``hold`` raises propagates; nothing stays).

    ``hold`` is the api layer's credit reservation (jobs never imports credits): it runs in the
    transaction that creates the job, with the new row. With dispatched_to, the job's run_job was
    already pushed to that deployment's primary (the fast path): the same transaction records the
    dispatch, so the row, the hold and JOB_DISPATCHED are written while the primary evaluates the
    prompt.
    """
    dispatch: dict[str, Any] = {}
    node_ids: list[str] = []
    if dispatched_to is not None:
        # Born DISPATCHED: the row, its hold and JOB_DISPATCHED (QUEUED → DISPATCHED, as
        # job_dispatch records it) in one transaction, without a transition of a row no one else
        # can see yet.
        node_ids = dispatch_node_ids(dispatched_to)
        dispatch = _dispatch_fields(dispatched_to, now=now)
    with transaction.atomic():
        job = Job.objects.create(
            id=job_id or uuid.uuid4(),
            model=model,
            account_id=account_id,
            api_key_id=api_key_id,
            kind=kind,
            params=params,
            max_tokens=max_tokens,
            stream=stream,
            request_id=request_id,
            queued_at=now,
            state=J.DISPATCHED if dispatched_to is not None else J.QUEUED,
            **dispatch,
        )
        if hold is not None:
            hold(job)
        if dispatched_to is not None:
            event_record(
                kind="JOB_DISPATCHED",
                category=EventCategory.EXECUTION,
                now=now,
                job_id=ids.job_id(job.id),
                deployment_id=ids.deployment_id(dispatched_to.id),
                old_state=J.QUEUED,
                new_state=J.DISPATCHED,
                message=f"to deployment {dispatched_to.id}",
                data={"nodes": node_ids},
            )
            if node_ids:
                through = Job.nodes.through
                through.objects.bulk_create([through(job_id=job.id, node_id=n) for n in node_ids])
    return job


def job_run_payload(
    *,
    job_id: JobId,
    deployment_id: DeploymentId,
    kind: str,
    max_tokens: int,
    params: dict[str, Any],
    id_slot: int | None = None,
    attempt: int | None = None,
    resume_tokens: list[int] | None = None,
) -> RunJobPayload:
    """The run_job command's payload. ``params`` is the job's stored request, the fields the /v1
    serializers validated (messages or prompt, sampling, stop, tools...: RunJobPayload's own);
    ``id_slot``: the llama-server slot the KV cache coordinator pinned; ``attempt`` and
    ``resume_tokens``: a failover's."""
    payload = cast(
        RunJobPayload,
        {
            **params,
            "job_id": str(job_id),
            "deployment_id": str(deployment_id),
            "kind": kind,
            "max_tokens": max_tokens,
        },
    )
    if id_slot is not None:
        payload["id_slot"] = id_slot
    if attempt is not None:
        payload["attempt"] = attempt
    if resume_tokens is not None:
        payload["resume_tokens"] = resume_tokens
    return payload


def _dispatch_fields(deployment: Deployment, *, now: datetime) -> dict[str, Any]:
    """The job's fields that a dispatch to this deployment sets."""
    plan = deployment.plan or {}
    return {
        "deployment_id": deployment.id,
        "dispatched_at": now,
        "placement": {
            "devices": dispatch_placement(deployment),
            "primary": plan.get("primary_node_id"),
        },
    }


def _record_dispatch(*, job: Job, deployment: Deployment, now: datetime) -> bool:
    """QUEUED → DISPATCHED with the plan's nodes and layers (the JOB_DISPATCHED event)."""
    node_ids = dispatch_node_ids(deployment)
    with transaction.atomic():
        moved = job_transition(
            job_id=ids.job_id(job.id),
            to=J.DISPATCHED,
            expected=J.QUEUED,
            now=now,
            fields=_dispatch_fields(deployment, now=now),
            kind="JOB_DISPATCHED",
            message=f"to deployment {deployment.id}",
            data={"nodes": node_ids},
        )
        if moved:
            job.nodes.set(node_ids)  # type: ignore[arg-type]  # pks; the stubs take only int pks
    return moved


def job_dispatch(
    *, job_id: JobId, deployment: Deployment, now: datetime, id_slot: int | None = None
) -> dict[str, Any]:
    """QUEUED → DISPATCHED: push run_job onto the primary's queue, then record the plan's nodes.

    The push goes first: the primary starts on the prompt while the transition is written. If the
    job stopped being QUEUED meanwhile (cancelled), the primary is told to cancel it.
    The caller holds a slot for the job (admission); any failure here gives it back.
    ``id_slot``: the llama-server slot the KV cache coordinator pinned (apps/jobs/kvcache.py).
    """
    try:
        if deployment.primary_id is None:  # a command to no node would sit in a "None" queue
            raise DeploymentError(f"deployment {deployment.id} has no primary")
        job = Job.objects.only("id", "kind", "max_tokens", "params").get(pk=job_id)
        payload = job_run_payload(
            job_id=ids.job_id(job.id),
            deployment_id=ids.deployment_id(deployment.id),
            kind=job.kind,
            max_tokens=job.max_tokens,
            params=job.params,
            id_slot=id_slot,
        )
        command_send(node_id=ids.node_id(deployment.primary_id), kind="run_job", payload=payload)
        if not _record_dispatch(job=job, deployment=deployment, now=now):
            job_cancel_flag(job_id=ids.job_id(job.id), node_id=ids.node_id(deployment.primary_id))
            raise DeploymentError("job is no longer queued")
    except BaseException:
        admission.slot_release(deployment_id=ids.deployment_id(deployment.id), job_id=job_id)
        raise
    return {"nodes": dispatch_node_ids(deployment), "primary": str(deployment.primary_id)}


def dispatch_placement(deployment: Deployment) -> list[dict[str, Any]]:
    """The plan's devices as a job's dispatch records them: node, device and layer range."""
    return [
        {
            "node_id": d["node_id"],
            "node": selectors.node_name(d["node_id"]),
            "device": d["device"],
            "layers": [d["layer_start"], d["layer_end"]],
        }
        for d in (deployment.plan or {}).get("devices", [])
    ]


def dispatch_node_ids(deployment: Deployment) -> list[str]:
    return list(dict.fromkeys(d["node_id"] for d in (deployment.plan or {}).get("devices", [])))


def job_mark_running(*, job_id: JobId, now: datetime) -> bool:
    """DISPATCHED → RUNNING at the first token: one guarded UPDATE (the transition writes no
    event, so it needs no read first; a job no longer DISPATCHED is left as it is)."""
    return (
        Job.objects.filter(pk=job_id, state=J.DISPATCHED).update(
            state=J.RUNNING, first_token_at=now
        )
        == 1
    )


def _finish(
    *,
    job_id: JobId,
    to: str,
    now: datetime,
    fields: dict[str, Any],
    kind: str,
    message: str,
    attempts: bool | None = None,
) -> bool:
    """The guarded move to a terminal state, its event, its last attempt's end, and what follows
    (slot, settlement, metrics, stream, drains). ``attempts=False``: the caller knows the job was
    never failed over (it has no JobAttempt rows), so none is looked for."""
    job = (
        Job.objects.filter(pk=job_id)
        .values("state", "deployment_id", "model__name", "queued_at", "dispatched_at")
        .first()
    )
    if job is None or job["state"] in JOB_TERMINAL:
        return False
    src = str(job["state"])
    with transaction.atomic():  # the job's end and its last attempt's, seen together
        # Guarded on the state just read (no second read): a writer that moved the job since
        # (its first token, a report) makes it a no-op, and the guarded transition reads again.
        moved = (
            to in JOB_TRANSITIONS.get(src, ())
            and Job.objects.filter(pk=job_id, state=src).update(state=to, finished_at=now, **fields)
            == 1
        )
        if moved:
            event_record(
                kind=kind,
                category=EventCategory.EXECUTION,
                now=now,
                job_id=job_id,
                old_state=src,
                new_state=to,
                message=message,
            )
        else:
            moved = job_transition(
                job_id=job_id,
                to=to,
                now=now,
                fields={"finished_at": now, **fields},
                kind=kind,
                message=message,
            )
        if moved and attempts is not False:
            _attempt_close(job_id=job_id, to=to, now=now, fields=fields)
    if moved:
        if job["deployment_id"]:
            admission.slot_release(
                deployment_id=ids.deployment_id(job["deployment_id"]), job_id=job_id
            )
        # Settled in a batch with the other jobs that end meanwhile (settle_queue.py).
        transaction.on_commit(functools.partial(settle_queue.settle_request, job_id=job_id))
        _record_job_metrics(
            job_id=job_id,
            to=to,
            fields=fields,
            row=(job["model__name"], job["queued_at"], job["dispatched_at"], now),
        )
        # The job's stream goes now unless someone still follows it (then at their end).
        transaction.on_commit(functools.partial(retention.job_stream_release, job_id=job_id))
        if job["deployment_id"]:
            # A draining node's last job may just have ended: its drain moves on (after commit,
            # so that the drain's own queries see this job finished).
            transaction.on_commit(
                functools.partial(
                    drains_advance,
                    deployments=Deployment.objects.filter(pk=job["deployment_id"]),
                    now=now,
                )
            )
    return moved


def _attempt_close(*, job_id: JobId, to: str, now: datetime, fields: dict[str, Any]) -> None:
    """A failed-over job's end closes its last attempt, which produced what the others did not."""
    last = (
        JobAttempt.objects.filter(job_id=job_id, ended_at__isnull=True).order_by("-number").first()
    )
    if last is None:
        return  # never failed over: the job is its one attempt
    before = JobAttempt.objects.filter(job_id=job_id, number__lt=last.number).aggregate(
        tokens=Sum("completion_tokens"), chunks=Sum("chunks")
    )
    total = int(fields.get("completion_tokens") or 0)
    chunks = int(fields.get("stream_chunks") or 0)
    JobAttempt.objects.filter(pk=last.pk).update(
        ended_at=now,
        outcome=to,
        error=str(fields.get("error") or "")[:2000],
        completion_tokens=max(0, total - int(before["tokens"] or 0)),
        chunks=max(0, chunks - int(before["chunks"] or 0)),
    )


def _record_job_metrics(
    *, job_id: JobId, to: str, fields: dict[str, Any], row: tuple[Any, ...] | None = None
) -> None:
    """``row``: the job's model name, queued_at, dispatched_at and finished_at, read with the
    finish already (the metrics need not read them again)."""
    hooks.job_finished.send(sender=Job, job_id=job_id, state=to, fields=fields, row=row)


def job_complete(
    *,
    job_id: JobId,
    usage: dict[str, Any],
    finish_reason: str,
    chunks: int,
    now: datetime,
    device_seconds: dict[str, float] | None = None,
    attempts: bool | None = None,
) -> bool:
    """→ COMPLETED with usage and timings; settlement follows. ``attempts``: as _finish's."""
    fields = {
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "ttft_ms": usage.get("ttft_ms"),
        "tokens_per_s": usage.get("tokens_per_s"),
        "finish_reason": finish_reason or "stop",
        "stream_chunks": chunks,
    }
    if device_seconds:
        fields["device_seconds"] = device_seconds
    return _finish(
        job_id=job_id,
        to=J.COMPLETED,
        now=now,
        fields=fields,
        kind="JOB_COMPLETED",
        message=f"{fields['completion_tokens']} tokens, {fields['finish_reason']}",
        attempts=attempts,
    )


def job_fail(
    *,
    job_id: JobId,
    now: datetime,
    error: str,
    during_execution: bool | None = None,
    usage: dict[str, Any] | None = None,
    chunks: int | None = None,
    attempts: bool | None = None,
) -> bool:
    """→ FAILED with the error; only what was delivered is charged. ``attempts``: as _finish's."""
    fields: dict[str, Any] = {
        "error": error[:2000],
        "failed_during_execution": during_execution,
        "finish_reason": "error",
    }
    if usage:
        fields["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        fields["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    if chunks is not None:
        fields["stream_chunks"] = chunks
    return _finish(
        job_id=job_id,
        to=J.FAILED,
        now=now,
        fields=fields,
        kind="JOB_FAILED",
        message=error[:300],
        attempts=attempts,
    )


def job_cancel(
    *,
    job_id: JobId,
    now: datetime,
    reason: str = "cancelled",
    usage: dict[str, Any] | None = None,
    chunks: int | None = None,
    attempts: bool | None = None,
) -> bool:
    """→ CANCELLED; sets the cancel flag the primary checks between tokens. ``attempts``: as
    _finish's."""
    job = Job.objects.filter(pk=job_id).select_related("deployment").first()
    if (
        job is not None
        and job.deployment is not None
        and job.deployment.primary_id
        and job.state in JOB_IN_FLIGHT
    ):
        job_cancel_flag(job_id=ids.job_id(job_id), node_id=ids.node_id(job.deployment.primary_id))
        command_send(
            node_id=ids.node_id(job.deployment.primary_id),
            kind="cancel_job",
            payload={"job_id": job_id},
        )
    fields: dict[str, Any] = {"finish_reason": "cancelled", "error": reason[:2000]}
    if usage:
        fields["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        fields["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    if chunks is not None:
        fields["stream_chunks"] = chunks
    return _finish(
        job_id=job_id,
        to=J.CANCELLED,
        now=now,
        fields=fields,
        kind="JOB_CANCELLED",
        message=reason[:300],
        attempts=attempts,
    )


def job_finish_from_report(*, node_id: NodeId, payload: dict[str, Any], now: datetime) -> None:
    """The agent's job_finished report: the same guarded finish as the stream reader's.

    The counts billed are the controller's own, from the job's stream (a node's report is a
    claim); the report's figures are only the cross-check.
    """
    job_id = payload.get("job_id")
    if not job_id:
        raise ValueError("job_finished needs job_id")
    # Only the primary of the job's plan runs it: anyone else's report is refused, changing nothing.
    job_id, job = _job_primary_row(job_id=job_id, node_id=node_id)
    status = payload.get("status")
    if status not in ("completed", "failed", "cancelled"):
        raise ValueError(f"unknown job status {status!r}")
    if job["state"] in JOB_TERMINAL:
        return  # the stream reader (or a sweep) finished it first, as it usually does
    attempt = _report_attempt(payload)
    current = (
        JobAttempt.objects.filter(job_id=job_id)
        .order_by("-number")
        .values("number", "primary_id", "ended_at")
        .first()
    )
    if current is not None and (
        attempt < current["number"]
        or str(current["primary_id"]) != str(node_id)
        or current["ended_at"] is not None
    ):
        # The same job id after a failover is the same job: the superseded attempt's end is news
        # about that attempt only, already recorded when the job moved on.
        log.info(
            "job %s: job_finished (%s) of superseded attempt %d from node %s ignored; attempt %d runs on node %s",
            job_id,
            status,
            attempt,
            node_id,
            current["number"],
            current["primary_id"],
        )
        return
    if status != "completed" and admission.job_reader_live(
        deployment_id=job["deployment_id"], job_id=ids.job_id(job_id)
    ):
        # A live reader saw the same end in the stream (or flagged the old primary to stop while
        # it fails the job over): it moves the job on, or records the end itself.
        log.info(
            "job %s: job_finished (%s) from node %s left to the job's live reader",
            job_id,
            status,
            node_id,
        )
        return
    claimed = {
        k: payload.get(k)
        for k in ("prompt_tokens", "completion_tokens", "ttft_ms", "tokens_per_s")
        if payload.get(k) is not None
    }
    chunks, tokens = streams.stream_tally(
        ids.job_id(job_id), node_id, attempt=current["number"] if current is not None else None
    )
    if current is not None:
        before = JobAttempt.objects.filter(job_id=job_id, number__lt=current["number"]).aggregate(
            t=Sum("completion_tokens"), c=Sum("chunks")
        )
        tokens += int(before["t"] or 0)
        chunks += int(before["c"] or 0)
    usage = streams.billed_usage(
        completion_tokens=tokens,
        agent_usage=claimed,
        prompt_bound=streams.prompt_token_bound(kind=job["kind"], params=job["params"] or {}),
        job_id=ids.job_id(job_id),
        check=status == "completed",
    )
    if status == "completed":
        job_complete(
            job_id=ids.job_id(job_id),
            usage=usage,
            finish_reason=payload.get("finish_reason") or "stop",
            chunks=chunks,
            now=now,
            device_seconds=payload.get("device_seconds"),
        )
    elif status == "failed":
        job_fail(
            job_id=ids.job_id(job_id),
            now=now,
            error=str(payload.get("error") or "failed on the node"),
            during_execution=True,
            usage=usage,
            chunks=chunks,
        )
    else:
        job_cancel(
            job_id=ids.job_id(job_id),
            now=now,
            reason=str(payload.get("error") or "cancelled on the node"),
            usage=usage,
            chunks=chunks,
        )


def _report_attempt(payload: dict[str, Any]) -> int:
    try:
        return max(1, int(payload.get("attempt") or 1))
    except (TypeError, ValueError):
        return 1
