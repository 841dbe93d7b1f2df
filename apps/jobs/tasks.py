"""Celery entry points for jobs and deployments. Thin: one call into services each."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils import timezone

from apps.nodes import gpu_challenges, links
from racon.ids import DeploymentId, NodeId

from . import admission, kvtransfer, placement, retention
from .autoscale import replicas_autoscale
from .challenges import node_speed_challenge, speed_challenge_due
from .deployments import deployments_on_node_state
from .params_retention import job_params_sweep
from .rollup import rollup_write
from .stale import jobs_fail_stale


@shared_task(name="racon.jobs.node_state_changed", ignore_result=True)
def node_state_changed(*, node_id: NodeId, state: str, **kwargs: Any) -> None:
    """React to a member node's health change (deployments degrade, fail and get replaced)."""
    deployments_on_node_state(node_id=node_id, state=state, now=timezone.now())
    if state == "READY":
        links.links_probe_request(node_id=node_id)
        if speed_challenge_due(node_id=node_id):
            # Its own task (the placement queue): the challenge waits on the agent's answer.
            speed_challenge.delay(node_id=node_id)
        elif gpu_challenges.gpu_challenge_due(node_id=node_id, now=timezone.now()):
            # One timed work at a time: after a CPU challenge, its task sends this one.
            gpu_challenge.delay(node_id=node_id)


@shared_task(name="racon.jobs.place_deployment", ignore_result=True)
def place_deployment(*, deployment_id: DeploymentId, **kwargs: Any) -> None:
    """Plan, load and confirm a deployment (idempotent: only a PLANNING deployment is placed)."""
    placement.deployment_place(deployment_id=deployment_id)


@shared_task(name="racon.jobs.speed_challenge", ignore_result=True)
def speed_challenge(*, node_id: NodeId, **kwargs: Any) -> str:
    """Time and check a node's speed claim (sent when the node turns READY with an unchecked claim)."""
    outcome = node_speed_challenge(node_id=node_id, now=timezone.now()).outcome
    if gpu_challenges.gpu_challenge_due(node_id=node_id, now=timezone.now()):
        gpu_challenge.delay(node_id=node_id)
    return outcome


@shared_task(name="racon.jobs.gpu_challenge", ignore_result=True)
def gpu_challenge(*, node_id: NodeId, device: str | None = None, **kwargs: Any) -> str:
    """Time and check one unverified GPU's claim on the GPU (rate-limited per node; a refusal is
    the outcome, not an error)."""
    try:
        return gpu_challenges.node_gpu_challenge(
            node_id=node_id, device=device, now=timezone.now()
        ).outcome
    except gpu_challenges.ChallengeRefused as exc:
        return f"refused: {exc.code}"


@shared_task(name="racon.jobs.stale_jobs_sweep", ignore_result=True)
def stale_jobs_sweep(**kwargs: Any) -> dict[str, int]:
    """Fail or finish jobs left non-terminal (beat: every 30 s)."""
    return jobs_fail_stale(now=timezone.now())


@shared_task(name="racon.jobs.autoscale", ignore_result=True)
def autoscale(**kwargs: Any) -> dict[str, Any]:
    """Replicas follow load: one more under sustained queueing, idle added ones stopped (beat)."""
    return replicas_autoscale(now=timezone.now()).to_dict()


@shared_task(name="racon.jobs.links_reprobe", ignore_result=True)
def links_reprobe(**kwargs: Any) -> dict[str, int]:
    """Expire stale link measurements and have READY nodes re-probe their stalest peers (beat:
    every LINK_PROBE_INTERVAL_SECONDS)."""
    return links.links_reprobe(now=timezone.now())


@shared_task(name="racon.jobs.admission_sweep", ignore_result=True)
def admission_sweep(**kwargs: Any) -> dict[str, int]:
    """Reclaim slot leases and queue entries that crashed views left (beat: every 15 s)."""
    return admission.admission_sweep(now=timezone.now())


@shared_task(name="racon.jobs.kv_transfer", ignore_result=True)
def kv_transfer(*, deployment_id: DeploymentId, **kwargs: Any) -> dict[str, Any]:
    """Move a draining replica's conversations (KV state) to another replica, or drop them with an
    event (placement queue: it waits on two agents)."""
    out = kvtransfer.deployment_kv_transfer(deployment_id=deployment_id, now=timezone.now())
    return {"moved": out.moved, "dropped": out.dropped, "bytes": out.bytes, "seconds": out.seconds}


@shared_task(name="racon.jobs.rollup", ignore_result=True)
def rollup(**kwargs: Any) -> dict[str, int]:
    """Roll jobs and node telemetry into per-minute rows for the charts, and sweep old rows (beat:
    every ROLLUP_PERIOD_SECONDS)."""
    return rollup_write(now=timezone.now())


@shared_task(name="racon.jobs.params_retention_sweep", ignore_result=True)
def params_retention_sweep(**kwargs: Any) -> int:
    """Remove finished jobs' prompts past JOB_PARAMS_RETENTION_DAYS (beat: hourly; issue 28)."""
    return job_params_sweep(now=timezone.now())


@shared_task(name="racon.jobs.job_streams_prune", ignore_result=True)
def job_streams_prune(**kwargs: Any) -> int:
    """Delete the streams of jobs that ended more than JOB_STREAM_KEEP_SECONDS ago (beat: each
    minute)."""
    return retention.job_streams_prune(now=timezone.now())
