"""Serving one inference request: admit it, wait for a slot, dispatch it, open its stream, record its end.

The request's path (docs/design/serving.md): find the model, create the job with its credit hold,
route to a READY deployment (or place one and wait, bounded), take a slot, push run_job onto the
primary's queue, then follow the job's Redis stream. Slots and the waiting queue are
``admission``'s, the stream and its token counts ``streams``'; this module strings them together
for the /v1 views (the api layer's v1 package), which validate, make these calls and shape OpenAI's responses.

Jobs never imports credits: the api layer passes the credit hold in as a callback that runs in the
transaction creating the job (what it raises, InsufficientCredits, propagates unchanged), and the
account's standing as a callable read only if the request has to queue. Errors are this module's
own exceptions (ModelNotFound, ContextTooLong, admission's wait errors, streams.StreamFailure),
which the view turns into OpenAI's error bodies.

This module sits above admission, services, selectors and streams (all of which import admission),
so that admission stays the bottom of the app and nothing here forms a cycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.db.models import Max
from django.utils import timezone

from apps.models_repo.models import Model
from apps.nodes.commands import command_send, job_cancel_flag
from apps.nodes.models import Node
from apps.nodes.selectors import heartbeat_ages
from apps.nodes.states import PLACEABLE, NodeState
from racon import cache, ids
from racon.ids import AccountId, ApiKeyId, DeploymentId, JobId, ModelId, NodeId

from . import admission, kvcache, retention, selectors, streams
from .deployments import deployment_ensure
from .failover import (
    failover_engine_excludes,
    job_failover_begin,
    job_failover_dispatch,
    job_failover_left,
    job_failover_route,
)
from .jobs import (
    DeploymentError,
    dispatch_node_ids,
    job_cancel,
    job_complete,
    job_create,
    job_dispatch,
    job_fail,
    job_run_payload,
)
from .models import Deployment, Job
from .states import DEPLOYMENT_SERVING
from .streams import FailoverTarget, StreamFailure

log = logging.getLogger("racon.jobs.serving")

MODEL_CACHE = "model"  # racon/cache.py: invalidated by Model and ModelFile writes (api signals)

Outcome = Literal["completed", "cancelled", "failed"]
# The api layer's credit hold: the new job and the most prompt tokens it can be charged for.
CreditHold = Callable[[Job, int], None]
# The api layer's gate, run once the request's prompt bound is known and before anything is sent
# to a node or written: (job id, model, prompt bound, max_tokens). It raises to refuse (no
# balance, a key over its limits); what it returns is called once when the job ends.
Gate = Callable[[JobId, Model, int, int], Callable[[], None] | None]


def pooled(fn: Any) -> Any:
    """Run a request's synchronous step on the shared thread pool, not the single thread
    sync_to_async uses by default: with 8-16 streams, admission, first-token and finish steps of
    different requests would otherwise queue behind each other (measured in bench/concurrency.py:
    time to first token at 8 streams). Each pool thread keeps its own database connection."""
    return sync_to_async(fn, thread_sensitive=False)


class ModelNotFound(Exception):
    """No servable model (one with a file) has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class ContextTooLong(Exception):
    """The request asks for more tokens than the routed deployment's context holds."""

    def __init__(self, *, max_tokens: int, n_ctx: int) -> None:
        super().__init__(f"{max_tokens} > {n_ctx}")
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx


@dataclass
class Admission:
    """One request's job on its way through admission, dispatch and its stream."""

    job_id: JobId
    model_name: str
    model_id: ModelId | None = None
    deployment_id: DeploymentId | None = None
    primary_id: NodeId | None = (
        None  # the node that runs it: its stream and cancel keys are under it
    )
    dispatched: bool = False
    nodes: list[str] = field(default_factory=list)
    n_parallel: int = 1
    account_id: AccountId | None = None
    queued_ts: float = 0.0
    prompt_bound: int | None = None
    max_tokens: int | None = None  # the job's own: the follower cuts the stream there
    follower: streams.StreamFollower | None = None
    handed_off: bool = False  # the streaming body owns the job from here
    failed_over: bool = False  # a failover began: the job may have JobAttempt rows
    finished: bool = False  # a finish (or a cancel) was recorded
    finishing: Future[None] | None = None  # the record of an end made off a cancelled task
    kv: kvcache.Route | None = None  # the KV cache coordinator's routing and slot (kvcache.py)
    release: Callable[[], None] | None = None  # the gate's, called once at the job's end
    follow_token: str = ""  # this request follows the job's stream (retention.stream_follow_*)


# --- admission (one sync hop) ---------------------------------------------------------------------


def model_servable(*, name: str) -> Model | None:
    """The servable model of this name (one with a file), through the process cache."""

    def load() -> Model | None:
        model = Model.objects.filter(name=name).first()
        return model if model is not None and model.files.exists() else None

    return cache.cached(MODEL_CACHE, name, load)


def prompt_hold_tokens(*, kind: str, params: dict[str, Any], max_tokens: int, n_ctx: int) -> int:
    """The most prompt tokens a request is held for and can be charged: its bytes (plus the
    template's), and never more than the slot's context leaves beside max_tokens, so a 2 MB
    prompt does not hold 2 million tokens."""
    return max(
        0, min(streams.prompt_token_bound(kind=kind, params=params), int(n_ctx) - max_tokens)
    )


def admission_open(
    *,
    model_name: str,
    account_id: AccountId | None,
    api_key_id: ApiKeyId | None,
    kind: str,
    params: dict[str, Any],
    max_tokens: int | None,
    stream: bool,
    request_id: str,
    hold: CreditHold | None,
    now: datetime,
    gate: Gate | None = None,
) -> Admission:
    """Find the model, create the job with its credit hold; dispatch at once when a slot is free.

    Raises ModelNotFound, ContextTooLong, whatever ``gate`` raises (before the prompt leaves the
    controller: nothing is sent or written), or whatever ``hold`` raises (nothing stays: no job,
    no slot, and a primary already sent the job is told to cancel it). Without a free slot the
    job is QUEUED on a deployment (one is created when the model has none): admission_wait
    follows.
    """
    model = model_servable(name=model_name)
    if model is None:
        raise ModelNotFound(model_name)
    max_tokens = int(max_tokens or settings.DEFAULT_MAX_TOKENS)
    model_id = ids.model_id(model.id)
    route = kvcache.route_request(model_id=model_id, kind=kind, params=params)
    deployment = route.deployment
    if deployment is not None and max_tokens > deployment.n_ctx:
        raise ContextTooLong(max_tokens=max_tokens, n_ctx=deployment.n_ctx)
    prompt_bound = prompt_hold_tokens(
        kind=kind,
        params=params,
        max_tokens=max_tokens,
        n_ctx=deployment.n_ctx if deployment is not None else settings.DEFAULT_N_CTX,
    )
    job_id = uuid.uuid4()
    jid = ids.job_id(job_id)
    release = gate(jid, model, prompt_bound, max_tokens) if gate is not None else None
    adm = Admission(
        job_id=jid,
        model_name=model.name,
        model_id=model_id,
        account_id=account_id,
        queued_ts=now.timestamp(),
        prompt_bound=prompt_bound,
        max_tokens=max_tokens,
        kv=route,
        release=release,
    )
    try:
        # Registered before the job can be dispatched: its stream is never deleted under us.
        adm.follow_token = retention.stream_follow_begin(job_id=jid)
        return _admission_start(
            adm=adm,
            route=route,
            create=create_args(
                model=model,
                account_id=account_id,
                api_key_id=api_key_id,
                kind=kind,
                params=params,
                max_tokens=max_tokens,
                stream=stream,
                request_id=request_id,
                now=now,
                job_id=job_id,
                hold=None if hold is None else (lambda job: hold(job, prompt_bound)),
            ),
        )
    except BaseException:
        admission_released(adm=adm)
        raise


def create_args(**kw: Any) -> dict[str, Any]:
    """services.job_create's arguments."""
    return kw


def admission_released(*, adm: Admission, ended_on: list[str] | None = None) -> None:
    """Call the gate's release once (the job ended, or was never created). ``ended_on``: the
    job's end is recorded and its attempts ran on these primaries (retention.stream_follow_end)."""
    release, adm.release = adm.release, None
    if release is not None:
        try:
            release()
        except Exception:  # a lease bounds what a lost release keeps
            log.warning("job %s: the quota release failed", adm.job_id, exc_info=True)
    token, adm.follow_token = adm.follow_token, ""
    if token:
        try:
            retention.stream_follow_end(job_id=adm.job_id, token=token, ended_on=ended_on)
        except Exception:  # the follower's lease and the beat's sweep bound what stays
            log.warning("job %s: the stream release failed", adm.job_id, exc_info=True)


def _admission_start(*, adm: Admission, route: kvcache.Route, create: dict[str, Any]) -> Admission:
    """admission_open's second half: the fast path's dispatch, or the job QUEUED on a deployment."""
    deployment = route.deployment
    model, kind, params = create["model"], create["kind"], create["params"]
    job_id, max_tokens, now = create["job_id"], create["max_tokens"], create["now"]
    fast = deployment if deployment is not None and deployment.state in DEPLOYMENT_SERVING else None
    # Fast path: a free slot with nobody waiting. Push run_job first, then write the job row,
    # its credit hold and the dispatch in one transaction while the primary evaluates the prompt.
    # If the credits are short, the primary is told to cancel before any token reaches anyone.
    if fast is not None and admission.slot_try(
        deployment_id=fast.id, job_id=job_id, cap=fast.n_parallel
    ):
        try:
            slot = kvcache.slot_claim(
                route=route, deployment_id=fast.id, job_id=job_id, n_parallel=fast.n_parallel
            )
            payload = job_run_payload(
                job_id=job_id,
                deployment_id=fast.id,
                kind=kind,
                max_tokens=max_tokens,
                params=params,
                id_slot=slot,
            )
            command_send(node_id=fast.primary_id, kind="run_job", payload=payload)
            job_create(**create, dispatched_to=fast)
        except BaseException:
            job_cancel_flag(job_id=ids.job_id(job_id), node_id=ids.node_id(fast.primary_id))
            admission.slot_release(deployment_id=fast.id, job_id=job_id)
            kvcache.slot_release(route=route, job_id=job_id)
            raise
        adm.deployment_id, adm.dispatched, adm.n_parallel = (
            ids.deployment_id(fast.id),
            True,
            fast.n_parallel,
        )
        adm.primary_id = ids.node_id(fast.primary_id)
        adm.nodes = [selectors.node_name(NodeId(n)) for n in dispatch_node_ids(fast)]
        return adm
    job_create(**create)
    if deployment is None:
        deployment = deployment_ensure(model=model, now=now)
    adm.deployment_id = ids.deployment_id(deployment.id)
    adm.n_parallel = deployment.n_parallel
    return adm


def priority_score(*, queued_at: float, standing: float) -> float:
    """Lower is served first: arrival time minus the standing bonus (admission.priority_bonus). A request's
    priority grows with its wait, and the bonus is below PRIORITY_MAX_WAIT_SECONDS: one that has
    waited that long is ahead of every request that arrives after it, whatever their standing
    (bounded starvation)."""
    return queued_at - admission.priority_bonus(standing)


async def admission_wait(*, adm: Admission, standing: Callable[[], float]) -> None:
    """Wait (bounded) for a serving deployment and a slot, then dispatch.

    ``standing`` (the account's, from the api layer) is read only if the request has to queue.
    On DeploymentUnavailable, QueueFull or WaitTimedOut the job is recorded FAILED (not during
    execution) and the error propagates.
    """
    load_timeout = max(settings.DEPLOYMENT_WAIT_SECONDS, settings.JOB_QUEUE_WAIT_SECONDS)
    deadline = time.monotonic() + load_timeout
    tried: set[str] = set()
    # A follow-up whose prefix-owning replica is full waits for it only this long (kvcache.py).
    affinity = adm.kv is not None and adm.kv.affinity_wait > 0 and adm.kv.fallback is not None
    try:
        while True:
            assert adm.deployment_id is not None, "admitted onto a deployment"
            try:
                await admission.wait_for_slot(
                    deployment_id=adm.deployment_id,
                    job_id=adm.job_id,
                    model_id=adm.model_id,
                    queued_at=adm.queued_ts,
                    priority=lambda: priority_score(queued_at=adm.queued_ts, standing=standing()),
                    load_timeout=max(0.0, deadline - time.monotonic()),
                    slot_timeout=adm.kv.affinity_wait
                    if affinity and adm.kv is not None
                    else settings.JOB_QUEUE_WAIT_SECONDS,
                )
                break
            except admission.WaitTimedOut:
                if not affinity or adm.kv is None:
                    raise
                affinity = False
                other = kvcache.route_fallback(route=adm.kv)
                adm.deployment_id, adm.n_parallel = ids.deployment_id(other.id), other.n_parallel
            except admission.DeploymentUnavailable:
                # The deployment it queued on failed (or was stopped): a queued job is not lost
                # with it, it waits on another replica, or on the replacement being placed.
                tried.add(str(adm.deployment_id))
                other = await pooled(job_failover_route)(
                    model_id=adm.model_id, exclude=tried, now=timezone.now()
                )
                if other is None:
                    other = await capacity_await(adm=adm, tried=tried, deadline=deadline)
                if other is None or time.monotonic() >= deadline:
                    raise
                log.warning(
                    "job %s: its deployment %s ended while it queued; it waits on %s",
                    adm.job_id,
                    adm.deployment_id,
                    other.id,
                )
                adm.deployment_id, adm.n_parallel = ids.deployment_id(other.id), other.n_parallel
    except admission.DeploymentUnavailable as exc:
        await pooled(admission_give_up)(
            adm=adm, reason=f"no deployment could serve the request: {exc.reason}"
        )
        raise
    except admission.QueueFull:
        await pooled(admission_give_up)(adm=adm, reason="no capacity: queue full")
        raise
    except admission.WaitTimedOut:
        await pooled(admission_give_up)(adm=adm, reason="timed out waiting for capacity")
        raise
    await pooled(admission_dispatch)(adm=adm)


# --- a node on its way (the first request after start) ---------------------------------------
#
# The first request after ``make run`` (or after a restart) can arrive while the only node is still
# handshaking: its placement is refused at once ("no eligible nodes"), and without this the request
# would 503 although the node turns READY seconds later. Such a request waits, within the same
# DEPLOYMENT_WAIT_SECONDS, while a node is on its way, and is placed again once one turned
# placeable; with no node on its way it still fails at once.

COMING_STATES = frozenset({NodeState.UNINITIALIZED, NodeState.REGISTERING, NodeState.OFFLINE})
COMING_POLL_SECONDS = 0.5


def nodes_coming(*, now: datetime) -> bool:
    """Whether a node is on its way to READY: enrolled or restarting (UNINITIALIZED, REGISTERING,
    or OFFLINE from its last run) and heard from within the offline threshold, not revoked and
    not being drained. A node silent for longer is not coming, however its row reads."""
    window = float(settings.HEARTBEAT_OFFLINE_AFTER) * float(settings.HEARTBEAT_INTERVAL)
    rows = list(
        Node.objects.filter(
            state__in=list(COMING_STATES), revoked_at__isnull=True, drain_requested=False
        ).values_list("id", "state", "state_changed_at")
    )
    if not rows:
        return False
    ages = heartbeat_ages([str(r[0]) for r in rows], now=now)
    since = now - timedelta(seconds=window)
    for node_id, state, changed in rows:
        age = ages.get(str(node_id))
        if age is not None and age <= window:
            return True  # heartbeating: an agent is running there
        # Handshaking but no heartbeat yet (the enrollment call came first).
        if state != NodeState.OFFLINE and changed is not None and changed >= since:
            return True
    return False


class _Wait:
    """capacity_step's answer while a node is still on its way."""


WAIT = _Wait()


def capacity_step(
    *, model_id: ModelId, tried: set[str], now: datetime
) -> Deployment | _Wait | None:
    """One look for somewhere to wait, after the deployments in ``tried`` ended: a deployment
    (another replica, the model's active one, or a new placement once a node turned placeable
    after the last tried one was created), WAIT while a node is on its way, or None."""
    dep = job_failover_route(model_id=model_id, exclude=tried, now=now)
    if dep is not None:
        return dep
    since = Deployment.objects.filter(pk__in=list(tried)).aggregate(t=Max("created_at"))["t"]
    arrived = Node.objects.filter(
        state__in=list(PLACEABLE), revoked_at__isnull=True, drain_requested=False
    )
    if since is not None:
        arrived = arrived.filter(state_changed_at__gt=since)
    if since is not None and arrived.exists():
        # A node turned placeable after the refused placement was planned: place again now
        # (deployment_ensure makes one deployment between concurrent waiters).
        ensured = deployment_ensure(model=Model.objects.get(pk=model_id), now=now)
        return None if str(ensured.id) in tried else ensured
    return WAIT if nodes_coming(now=now) else None


async def capacity_await(*, adm: Admission, tried: set[str], deadline: float) -> Deployment | None:
    """Wait (until ``deadline``, monotonic) while a node is on its way; the deployment to wait on
    once there is one, None when nothing is coming or time ran out."""
    logged = False
    while time.monotonic() < deadline:
        got = await pooled(capacity_step)(model_id=adm.model_id, tried=tried, now=timezone.now())
        if not isinstance(got, _Wait):
            return got
        if not logged:
            log.info("job %s: no deployment yet, a node is on its way; waiting", adm.job_id)
            logged = True
        await asyncio.sleep(min(COMING_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
    return None


def admission_dispatch(*, adm: Admission) -> None:
    """Push the job to the deployment whose slot it holds (job_dispatch gives the slot back on failure)."""
    assert adm.deployment_id is not None  # admission_open set it
    try:
        deployment = Deployment.objects.get(pk=adm.deployment_id)
    except Deployment.DoesNotExist:
        admission.slot_release(deployment_id=adm.deployment_id, job_id=adm.job_id)
        raise
    slot = kvcache.slot_claim(
        route=adm.kv,
        deployment_id=ids.deployment_id(deployment.id),
        job_id=adm.job_id,
        n_parallel=deployment.n_parallel,
    )
    try:
        out = job_dispatch(
            job_id=adm.job_id, deployment=deployment, now=timezone.now(), id_slot=slot
        )
    except BaseException:
        kvcache.slot_release(route=adm.kv, job_id=adm.job_id)
        raise
    adm.dispatched = True
    adm.n_parallel = deployment.n_parallel
    adm.primary_id = out["primary"]
    adm.nodes = [selectors.node_name(n) for n in out["nodes"]]


def admission_give_up(*, adm: Admission, reason: str) -> None:
    """Record the job FAILED before it ran (no capacity, no deployment)."""
    adm.finished = True
    admission_released(adm=adm)
    job_fail(job_id=adm.job_id, now=timezone.now(), error=reason, during_execution=False)


# --- the stream -----------------------------------------------------------------------------------


async def stream_open(*, adm: Admission) -> tuple[dict[str, str], AsyncIterator[dict[str, str]]]:
    """Follow the dispatched job's stream and read its first entry, before any answer is sent.

    An early failure (a stream failure, or an error entry such as context_length_exceeded) is
    recorded on the job and raised as StreamFailure, so the view can answer with a status code.
    """

    async def failover(
        follower: streams.StreamFollower, failure: StreamFailure
    ) -> FailoverTarget | None:
        return await job_failover(adm=adm, follower=follower, failure=failure)

    assert adm.primary_id is not None, "a dispatched job has a primary"
    adm.follower = streams.StreamFollower(
        job_id=adm.job_id,
        deployment_id=adm.deployment_id,
        node_id=adm.primary_id,
        prompt_bound=adm.prompt_bound,
        failover=failover,
        max_tokens=adm.max_tokens,  # known: no read of the job before the first token
    )
    entries = adm.follower.entries()
    try:
        first = await entries.__anext__()
    except StreamFailure as exc:
        await pooled(admission_finish)(adm=adm, outcome="failed", error=exc.message, during=True)
        raise
    if first.get("type") == "error":
        failure = streams.error_for_entry(first)
        await pooled(admission_finish)(
            adm=adm,
            outcome="failed",
            entry=first,
            error=failure.message,
            during=failure.during_execution,
        )
        raise failure
    return first, entries


# --- failover -------------------------------------------------------------------------------------


async def job_failover(
    *, adm: Admission, follower: streams.StreamFollower, failure: StreamFailure
) -> FailoverTarget | None:
    """Move a job whose primary died, vanished or went silent to another replica (the
    follower's hook; docs/design/serving.md, "Failover").

    Records the attempt's end and fails a dead deployment (routing skips it at once), then waits
    at most FAILOVER_WAIT_SECONDS for a slot on another serving replica, or on the replacement
    being placed, ahead of every queued request, and dispatches the next attempt there with the
    token ids relayed so far. None (the job ends with ``failure``) when no capacity appears in
    time, or when the job ended meanwhile.
    """
    cause = streams.failover_cause(code=failure.code, text=failure.message) or failure.code
    wait = float(settings.FAILOVER_WAIT_SECONDS)
    old_dep, old_node, attempt = follower.deployment_id, follower.node_id, follower.attempt
    log.warning(
        "job %s: attempt %d on deployment %s ended (%s: %s) after %d tokens; failing over",
        adm.job_id,
        attempt,
        old_dep,
        cause,
        failure.message,
        follower.completion_tokens,
    )
    adm.failed_over = True  # before: JobAttempt rows start in it
    began = await pooled(job_failover_begin)(
        job_id=adm.job_id,
        deployment_id=old_dep,
        node_id=old_node,
        attempt=attempt,
        cause=cause,
        message=failure.message,
        chunks=follower.attempt_chunks,
        completion_tokens=follower.attempt_tokens,
        wait_seconds=wait,
        now=timezone.now(),
    )
    if not began:
        return None
    try:
        if follower.completion_tokens >= await pooled(job_failover_left)(
            job_id=adm.job_id, tokens_so_far=0
        ):
            return FailoverTarget(done=True)  # the dead attempt had produced everything asked for
        deadline = time.monotonic() + wait
        exclude = {str(old_dep)} if old_dep else set()
        if follower.ids:  # a resume: not where the job's output constraint cannot resume
            exclude |= await pooled(failover_engine_excludes)(
                job_id=adm.job_id, model_id=adm.model_id
            )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("job %s: no replica could take it over within %.0fs", adm.job_id, wait)
                return None
            dep = await pooled(job_failover_route)(
                model_id=adm.model_id, exclude=exclude, now=timezone.now()
            )
            if dep is None:
                await asyncio.sleep(min(0.5, left))
                continue
            try:
                # Score 0: ahead of every queued request (their scores are arrival times).
                await admission.wait_for_slot(
                    deployment_id=dep.id,
                    job_id=adm.job_id,
                    priority=0.0,
                    load_timeout=left,
                    slot_timeout=left,
                )
            except admission.DeploymentUnavailable:
                exclude.add(str(dep.id))
                continue
            except (admission.QueueFull, admission.WaitTimedOut):
                return None
            # The dead attempt's slot pin is given back and one on the new replica is taken, so
            # the KV coordinator never hands this attempt's slot to another job (found by the
            # real-agent pause test: a job pinned to the same slot produced nothing for 60 s).
            await pooled(kvcache.slot_release)(route=adm.kv, job_id=adm.job_id)
            slot = await pooled(kvcache.slot_claim)(
                route=adm.kv, deployment_id=dep.id, job_id=adm.job_id, n_parallel=dep.n_parallel
            )
            try:
                out = await pooled(job_failover_dispatch)(
                    job_id=adm.job_id,
                    deployment=dep,
                    attempt=attempt + 1,
                    resume_tokens=list(follower.ids),
                    from_deployment_id=old_dep,
                    from_node_id=old_node,
                    cause=cause,
                    now=timezone.now(),
                    id_slot=slot,
                )
            except DeploymentError:
                await pooled(kvcache.slot_release)(route=adm.kv, job_id=adm.job_id)
                return None
            adm.deployment_id, adm.primary_id = ids.deployment_id(dep.id), NodeId(out["primary"])
            adm.n_parallel = int(out.get("n_parallel") or dep.n_parallel)
            adm.nodes = [selectors.node_name(n) for n in out["nodes"]]
            gap = (
                time.monotonic() - follower.last_chunk_at
                if follower.last_chunk_at is not None
                else None
            )
            log.warning(
                "job %s: attempt %d dispatched to deployment %s (node %s), %d tokens resumed%s",
                adm.job_id,
                attempt + 1,
                dep.id,
                out["primary"],
                len(follower.ids),
                f", {gap:.2f}s since the last token" if gap is not None else "",
            )
            return FailoverTarget(
                deployment_id=ids.deployment_id(dep.id), node_id=out["primary"], attempt=attempt + 1
            )
    finally:
        await pooled(admission.failover_end)(job_id=adm.job_id)


# --- finishing ------------------------------------------------------------------------------------


def admission_usage(
    *, adm: Admission, entry: dict[str, str] | None = None, check: bool = True
) -> dict[str, Any]:
    """The usage to record and bill so far, by the controller's own counts (streams.StreamFollower)."""
    return adm.follower.usage(entry, check=check) if adm.follower is not None else {}


def admission_finish(
    *,
    adm: Admission,
    outcome: Outcome,
    entry: dict[str, str] | None = None,
    finish_reason: str = "stop",
    error: str = "",
    during: bool | None = None,
) -> None:
    """Record the job's end with the controller's own counts (streams.StreamFollower)."""
    adm.finished = True
    # The quota first (the key's next request may come at once); the stream's follower after
    # the end is recorded, so that its release finds the job terminal and deletes the stream once.
    follow_token, adm.follow_token = adm.follow_token, ""
    ended_on: list[str] | None = None
    try:
        admission_released(adm=adm)
        kv_finish(adm=adm, outcome=outcome, entry=entry)
        _job_end(
            adm=adm,
            outcome=outcome,
            entry=entry,
            finish_reason=finish_reason,
            error=error,
            during=during,
        )
        ended_on = _attempt_primaries(adm)
    finally:
        adm.follow_token = follow_token
        admission_released(adm=adm, ended_on=ended_on)


def _attempt_primaries(adm: Admission) -> list[str]:
    """The primaries this request's attempts ran on, as its follower saw them."""
    nodes: set[str] = {adm.primary_id} if adm.primary_id else set()
    if adm.follower is not None:
        nodes.add(adm.follower.node_id)
        nodes |= {str(f["from_node"]) for f in adm.follower.failovers}
    return sorted(n for n in nodes if n)


def _job_end(
    *,
    adm: Admission,
    outcome: Outcome,
    entry: dict[str, str] | None,
    finish_reason: str,
    error: str,
    during: bool | None,
) -> None:
    now = timezone.now()
    chunks = adm.follower.chunks if adm.follower is not None else 0
    attempts = None if adm.failed_over else False
    if outcome == "completed":
        job_complete(
            job_id=adm.job_id,
            usage=admission_usage(adm=adm, entry=entry),
            finish_reason=finish_reason,
            chunks=chunks,
            now=now,
            attempts=attempts,
        )
    elif outcome == "cancelled":
        job_cancel(
            job_id=adm.job_id,
            now=now,
            reason=error or "client disconnected",
            usage=admission_usage(adm=adm, entry=entry, check=False),
            chunks=chunks,
            attempts=attempts,
        )
    else:
        job_fail(
            job_id=adm.job_id,
            now=now,
            error=error,
            during_execution=during,
            usage=admission_usage(adm=adm, entry=entry, check=False),
            chunks=chunks,
            attempts=attempts,
        )


def kv_finish(*, adm: Admission, outcome: Outcome, entry: dict[str, str] | None) -> None:
    """Tell the KV cache coordinator the job ended (ownership; never fails the finish)."""
    try:
        usage = streams.entry_usage(entry) if entry is not None else {}
        served = usage.get("id_slot")
        kvcache.job_finished(
            route=adm.kv,
            job_id=adm.job_id,
            deployment_id=adm.deployment_id,
            completed=outcome == "completed",
            usage={**admission_usage(adm=adm, entry=entry, check=False), **usage},
            served_slot=int(served) if isinstance(served, int) else None,
        )
    except Exception:  # the cache record is advice; the job's end is not
        log.warning("job %s: the KV cache record was not updated", adm.job_id, exc_info=True)


FINISH_THREAD_PREFIX = "racon-finish"  # the pool's threads (admission_finish_in_background)
FINISH_THREADS = 4
# The ends recorded off a cancelled task run on one bounded pool per process, not a thread each:
# a burst of disconnects queues its records (each a few queries) instead of starting a thread per
# request. Threads are made on demand, so a process that never cancels starts none.
_finishers = ThreadPoolExecutor(max_workers=FINISH_THREADS, thread_name_prefix=FINISH_THREAD_PREFIX)


def admission_finish_in_background(
    *,
    adm: Admission,
    outcome: Outcome,
    entry: dict[str, str] | None = None,
    finish_reason: str = "stop",
    error: str = "",
) -> None:
    """Record the job's end off a task that is being cancelled (no await is safe there), on the
    bounded finisher pool; ``adm.finishing`` is the record's future."""
    if adm.finished:
        return
    adm.finished = True

    def run() -> None:
        try:
            admission_finish(
                adm=adm, outcome=outcome, entry=entry, finish_reason=finish_reason, error=error
            )
        finally:
            connections.close_all()  # this thread's own connection

    adm.finishing = _finishers.submit(run)


def admission_cancel(*, adm: Admission) -> None:
    """Client gone: flag the primary at once (Redis), record CANCELLED off the cancelled task."""
    if adm.finished:
        return
    try:
        if adm.primary_id:
            job_cancel_flag(job_id=ids.job_id(adm.job_id), node_id=ids.node_id(adm.primary_id))
    except Exception:
        log.warning("could not set the cancel flag", exc_info=True)
    admission_finish_in_background(adm=adm, outcome="cancelled", error="client disconnected")
