"""Admission: the only owner of deployment slots and of the waiting queue (docs/design/serving.md).

Keys, all written here and nowhere else:

- ``racon:dep:{dep}:slots``: ZSET job → slot lease expiry (unix seconds). A job holds one of the
  deployment's ``n_parallel`` slots from dispatch until it finishes (``slot_release``, called by
  the job's finish). The lease is ``max(2 × STREAM_IDLE_TIMEOUT_SECONDS, 30 s)`` and the stream
  follower renews it every ``SLOT_RENEW_SECONDS`` while it reads, chunk or not: a live reader gives
  up on a silent stream after STREAM_IDLE_TIMEOUT_SECONDS, so a lease only runs out when the view
  process that held it is gone. An expired lease is a crashed view's slot: the take script drops
  it before counting, and the beat sweep drops it too (the stale-jobs sweep fails the job itself).
- ``racon:dep:{dep}:waiting``: ZSET job → priority score, lowest first. The api layer computes the
  score from the account's standing (jobs never imports credits) and passes it in.
- ``racon:dep:{dep}:waitlease``: ZSET job → waiter lease expiry. A waiter renews it on every poll
  (at most ``WAIT_POLL_MAX_SECONDS`` apart) for ``WAIT_LEASE_SECONDS``; a lapsed waiter is a dead
  one and is dropped by the take script and by the sweep, so it never holds the head of the queue.
- ``racon:model:{model}:wait``: HASH ``ewma`` (seconds waited, decayed with a half-life of
  ``WAIT_HALF_LIFE_SECONDS`` since ``updated``), ``last_wait``, ``samples``, ``updated`` and
  ``last_queued`` (when someone last joined a queue of the model). The replica autoscaler reads it
  through ``model_queue_wait`` and ``model_queue_depth``.

A waiter that is cancelled, disconnected or timed out leaves at once: ``wait_for_slot`` removes its
entry in a ``finally`` with the asyncio client, shielded, so a cancelled view task still runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from racon.ids import DeploymentId, JobId, ModelId
from racon.redis import get_async_redis, get_redis

from .models import Deployment, Job
from .states import DEPLOYMENT_ACTIVE, DEPLOYMENT_ENDED, DEPLOYMENT_SERVING, JOB_TERMINAL

log = logging.getLogger("racon.jobs.admission")

WAIT_LEASE_SECONDS = 10.0
WAIT_POLL_MAX_SECONDS = 0.1
SLOT_RENEW_SECONDS = 5.0
WAIT_EWMA_ALPHA = 0.3
WAIT_HALF_LIFE_SECONDS = 60.0
MODEL_WAIT_TTL_SECONDS = 7 * 86400


def slots_key(deployment_id: DeploymentId) -> str:
    return f"racon:dep:{deployment_id}:slots"


def waiting_key(deployment_id: DeploymentId) -> str:
    return f"racon:dep:{deployment_id}:waiting"


def waitlease_key(deployment_id: DeploymentId) -> str:
    return f"racon:dep:{deployment_id}:waitlease"


def model_wait_key(model_id: ModelId) -> str:
    return f"racon:model:{model_id}:wait"


def slot_lease_seconds() -> float:
    """How long a slot stays taken without a renewal (see the module docstring)."""
    return max(2.0 * float(settings.STREAM_IDLE_TIMEOUT_SECONDS), 30.0)


class QueueFull(Exception):
    """The deployment's waiting queue already holds JOB_QUEUE_MAX live waiters."""


class WaitTimedOut(Exception):
    """No slot (or no READY deployment) within the wait limits."""


class DeploymentUnavailable(Exception):
    """The deployment failed, stopped or vanished while the request waited."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- scripts ---------------------------------------------------------------------------------------

# Take a slot. Purges expired slot leases and lapsed waiters first, so a crashed view never blocks
# anyone. A job may take a slot when one is free and every waiter ranked ahead of it also fits in
# the free slots (nobody ahead is passed over). A waiter that does not get one renews its lease.
# Returns 1 (took a slot), 0 (still queued) or -1 (neither: not, or no longer, in the queue).
# KEYS: slots, waiting, waitlease. ARGV: cap, job, now, slot lease until, wait lease until.
_TAKE_LUA = """
local now = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #lapsed > 0 then
  redis.call('ZREM', KEYS[2], unpack(lapsed))
  redis.call('ZREM', KEYS[3], unpack(lapsed))
end
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 1 end
local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local rank = redis.call('ZRANK', KEYS[2], ARGV[2])
local ahead = rank
if not rank then ahead = redis.call('ZCARD', KEYS[2]) end
if free > 0 and ahead < free then
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
  return 1
end
if rank then
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[2])
  return 0
end
return -1
"""

# Join the queue (or renew an entry already there). 0 when the queue is full of live waiters.
# KEYS: waiting, waitlease, model wait hash. ARGV: job, score, now, wait lease until, max, ttl,
# '1' to stamp the model's last_queued.
_JOIN_LUA = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  return 1
end
if redis.call('ZCOUNT', KEYS[2], '(' .. ARGV[3], '+inf') >= tonumber(ARGV[5]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
if ARGV[7] == '1' then
  redis.call('HSET', KEYS[3], 'last_queued', ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[6])
end
return 1
"""

# Fold one waited time into the model's EWMA (decayed to now first).
# KEYS: model wait hash. ARGV: seconds, now, alpha, half-life, ttl.
_WAIT_RECORD_LUA = """
local s = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local e = tonumber(redis.call('HGET', KEYS[1], 'ewma') or '')
local t = tonumber(redis.call('HGET', KEYS[1], 'updated') or '')
if e and t then
  local age = now - t
  if age < 0 then age = 0 end
  e = tonumber(ARGV[3]) * s + (1 - tonumber(ARGV[3])) * e * (0.5 ^ (age / tonumber(ARGV[4])))
else
  e = s
end
redis.call('HSET', KEYS[1], 'ewma', tostring(e), 'updated', ARGV[2], 'last_wait', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'samples', 1)
redis.call('EXPIRE', KEYS[1], ARGV[5])
return tostring(e)
"""

# Sweep one deployment's queue: drop waiters whose lease lapsed or is missing, and the given jobs.
# KEYS: waiting, waitlease. ARGV: now, finished job ids...
_SWEEP_QUEUE_LUA = """
local now = tonumber(ARGV[1])
local n = 0
for _, job in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local lease = tonumber(redis.call('ZSCORE', KEYS[2], job) or '0')
  if lease <= now then
    redis.call('ZREM', KEYS[1], job)
    n = n + 1
  end
end
for i = 2, #ARGV do
  n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
for _, job in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if not redis.call('ZSCORE', KEYS[1], job) then redis.call('ZREM', KEYS[2], job) end
end
return n
"""

_scripts: dict[tuple[str, int], Any] = {}


def _script(source: str, *, asynchronous: bool = False) -> Any:
    """A registered script (EVALSHA with a transparent reload), one per client kind and loop."""
    client = get_async_redis() if asynchronous else get_redis()
    key = (source, id(client))
    got = _scripts.get(key)
    if got is None:
        got = client.register_script(source)
        _scripts[key] = got
    return got


def _now(now: float | datetime | None) -> float:
    if now is None:
        return time.time()
    if isinstance(now, datetime):
        return now.timestamp()
    return float(now)


# --- slots -----------------------------------------------------------------------------------------


def slot_try(
    *, deployment_id: DeploymentId, job_id: JobId, cap: int, now: float | datetime | None = None
) -> bool:
    """Take a slot when one is free and nobody waiting ahead would be passed over (atomic)."""
    t = _now(now)
    keys = [slots_key(deployment_id), waiting_key(deployment_id), waitlease_key(deployment_id)]
    args = [
        int(cap),
        str(job_id),
        repr(t),
        repr(t + slot_lease_seconds()),
        repr(t + WAIT_LEASE_SECONDS),
    ]
    return int(_script(_TAKE_LUA)(keys=keys, args=args)) == 1


async def _aslot_take(*, deployment_id: DeploymentId, job_id: JobId, cap: int) -> int:
    """The take script on the asyncio client: 1 took a slot, 0 still queued, -1 not queued."""
    t = time.time()
    keys = [slots_key(deployment_id), waiting_key(deployment_id), waitlease_key(deployment_id)]
    args = [
        int(cap),
        str(job_id),
        repr(t),
        repr(t + slot_lease_seconds()),
        repr(t + WAIT_LEASE_SECONDS),
    ]
    return int(await _script(_TAKE_LUA, asynchronous=True)(keys=keys, args=args))


def slot_renew(
    *, deployment_id: DeploymentId, job_id: JobId, now: float | datetime | None = None
) -> bool:
    """Extend a held slot's lease; False when the job holds none (released or reclaimed)."""
    t = _now(now)
    return bool(
        get_redis().zadd(
            slots_key(deployment_id), {str(job_id): t + slot_lease_seconds()}, xx=True, ch=True
        )
    )


async def aslot_renew(
    *, deployment_id: DeploymentId, job_id: JobId, now: float | None = None
) -> bool:
    t = _now(now)
    return bool(
        await get_async_redis().zadd(
            slots_key(deployment_id), {str(job_id): t + slot_lease_seconds()}, xx=True, ch=True
        )
    )


def slot_release(*, deployment_id: DeploymentId, job_id: JobId) -> None:
    """Give back the job's slot and drop any queue entry it has. Idempotent."""
    job = str(job_id)
    with get_redis().pipeline(transaction=True) as pipe:
        pipe.zrem(slots_key(deployment_id), job)
        pipe.zrem(waiting_key(deployment_id), job)
        pipe.zrem(waitlease_key(deployment_id), job)
        pipe.execute()


async def aslot_release(*, deployment_id: DeploymentId, job_id: JobId) -> None:
    job = str(job_id)
    async with get_async_redis().pipeline(transaction=True) as pipe:
        pipe.zrem(slots_key(deployment_id), job)
        pipe.zrem(waiting_key(deployment_id), job)
        pipe.zrem(waitlease_key(deployment_id), job)
        await pipe.execute()


def _live_leases(
    key: Callable[[Any], str], deployment_ids: Iterable[Any], now: float | datetime | None
) -> dict[str, int]:
    """Unexpired leases in each deployment's lease ZSET, in one pipelined round trip."""
    ids = [str(d) for d in deployment_ids]
    if not ids:
        return {}
    t = _now(now)
    with get_redis().pipeline(transaction=False) as pipe:
        for d in ids:
            pipe.zcount(key(d), f"({t!r}", "+inf")
        counts = pipe.execute()
    return {d: int(c) for d, c in zip(ids, counts, strict=True)}


def slots_in_use(
    deployment_ids: Iterable[Any], *, now: float | datetime | None = None
) -> dict[str, int]:
    """Live (unexpired) slot leases per deployment id."""
    return _live_leases(slots_key, deployment_ids, now)


# --- failover (docs/design/serving.md, "Failover") -------------------------------------------------


def failover_key(job_id: JobId) -> str:
    return f"racon:job:{job_id}:failover"


def dead_key(deployment_id: DeploymentId) -> str:
    return f"racon:dep:{deployment_id}:dead"


def failover_begin(*, job_id: JobId, seconds: float) -> None:
    """The job's reader is moving it to another replica: sweeps and failure handlers leave it alone."""
    get_redis().set(failover_key(job_id), "1", ex=max(1, int(seconds)))


def failover_end(*, job_id: JobId) -> None:
    get_redis().delete(failover_key(job_id))


def job_reader_live(
    *, deployment_id: DeploymentId, job_id: JobId, now: float | datetime | None = None
) -> bool:
    """Whether a live reader owns the job's end: it holds an unexpired slot lease on the
    deployment, or it is failing the job over. Such a job is the reader's to fail over or to
    finish, never a failure handler's."""
    t = _now(now)
    with get_redis().pipeline(transaction=False) as pipe:
        pipe.exists(failover_key(job_id))
        if deployment_id is not None:
            pipe.zscore(slots_key(deployment_id), str(job_id))
        got = pipe.execute()
    if got[0]:
        return True
    return len(got) > 1 and got[1] is not None and float(got[1]) > t


def deployment_mark_dead(*, deployment_id: DeploymentId, seconds: float) -> None:
    """Routing skips this deployment at once, in every process, whatever its cached state says
    (a process's route cache may lag the invalidation broadcast by up to API_CACHE_SECONDS)."""
    get_redis().set(dead_key(deployment_id), "1", ex=max(1, int(seconds)))


@dataclass(frozen=True)
class Loads:
    """Deployments' routing state as one read saw it: those marked dead, and the live slot
    leases and live waiters of each."""

    dead: frozenset[str]
    used: dict[str, int]
    waiting: dict[str, int]


def loads_queue(
    pipe: Any, deployment_ids: Sequence[str], *, now: float | datetime | None = None
) -> Callable[[Iterator[Any]], Loads]:
    """Queue on ``pipe`` (a non-transactional pipeline another module executes, so that routing
    reads everything it needs in one round trip) the reads of the deployments' dead marks, slot
    leases and waiters. The returned function takes the pipeline's results, as an iterator
    positioned at the first of these, consumes exactly these, and gives the Loads."""
    ids = list(deployment_ids)
    if not ids:
        return lambda results: Loads(frozenset(), {}, {})
    t = _now(now)
    pipe.mget([dead_key(DeploymentId(d)) for d in ids])
    for key in (slots_key, waitlease_key):
        for d in ids:
            pipe.zcount(key(DeploymentId(d)), f"({t!r}", "+inf")

    def read(results: Iterator[Any]) -> Loads:
        marks = next(results)
        used = {d: int(next(results)) for d in ids}
        waiting = {d: int(next(results)) for d in ids}
        return Loads(frozenset(d for d, v in zip(ids, marks, strict=True) if v), used, waiting)

    return read


def deployments_dead(deployment_ids: Iterable[Any]) -> set[str]:
    """Those of the ids marked dead (one round trip)."""
    ids = [str(d) for d in deployment_ids]
    if not ids:
        return set()
    return {
        d
        for d, v in zip(
            ids, get_redis().mget([dead_key(DeploymentId(d)) for d in ids]), strict=True
        )
        if v
    }


# --- the waiting queue -----------------------------------------------------------------------------


def priority_bonus(standing: float) -> float:
    """Seconds a waiting request is moved ahead for its account's standing (what it lent
    recently, README "Priority"): PRIORITY_MAX_WAIT_SECONDS × s / (s + PRIORITY_STANDING_HALF).
    More lending always buys more, never the whole cap: a request that has waited
    PRIORITY_MAX_WAIT_SECONDS is ahead of every later one, whatever their standing."""
    s = max(0.0, float(standing))
    half = max(1.0, float(settings.PRIORITY_STANDING_HALF))
    return float(settings.PRIORITY_MAX_WAIT_SECONDS) * s / (s + half)


def _join_call(
    *,
    deployment_id: DeploymentId,
    job_id: JobId,
    priority: float,
    model_id: ModelId | None,
    now: float,
    max_depth: int | None,
) -> tuple[list[str], list[Any]]:
    keys = [
        waiting_key(deployment_id),
        waitlease_key(deployment_id),
        # the script touches the model's hash only with a model (ARGV[7])
        model_wait_key(model_id) if model_id is not None else waiting_key(deployment_id),
    ]
    cap = int(settings.JOB_QUEUE_MAX if max_depth is None else max_depth)
    args = [
        str(job_id),
        repr(float(priority)),
        repr(now),
        repr(now + WAIT_LEASE_SECONDS),
        cap,
        MODEL_WAIT_TTL_SECONDS,
        "0" if model_id is None else "1",
    ]
    return keys, args


def queue_join(
    *,
    deployment_id: DeploymentId,
    job_id: JobId,
    priority: float,
    model_id: ModelId | None = None,
    now: float | datetime | None = None,
    max_depth: int | None = None,
) -> bool:
    """Join (or stay in, renewing the lease) the deployment's queue at ``priority``; False when full."""
    keys, args = _join_call(
        deployment_id=deployment_id,
        job_id=job_id,
        priority=priority,
        model_id=model_id,
        now=_now(now),
        max_depth=max_depth,
    )
    return bool(_script(_JOIN_LUA)(keys=keys, args=args))


async def aqueue_join(
    *,
    deployment_id: DeploymentId,
    job_id: JobId,
    priority: float,
    model_id: ModelId | None = None,
    max_depth: int | None = None,
) -> bool:
    keys, args = _join_call(
        deployment_id=deployment_id,
        job_id=job_id,
        priority=priority,
        model_id=model_id,
        now=time.time(),
        max_depth=max_depth,
    )
    return bool(await _script(_JOIN_LUA, asynchronous=True)(keys=keys, args=args))


def queue_leave(*, deployment_id: DeploymentId, job_id: JobId) -> None:
    """Leave the queue (idempotent)."""
    with get_redis().pipeline(transaction=True) as pipe:
        pipe.zrem(waiting_key(deployment_id), str(job_id))
        pipe.zrem(waitlease_key(deployment_id), str(job_id))
        pipe.execute()


def queue_depth(
    deployment_ids: Iterable[Any], *, now: float | datetime | None = None
) -> dict[str, int]:
    """Live waiters (unlapsed wait leases) per deployment id."""
    return _live_leases(waitlease_key, deployment_ids, now)


def queue_order(*, deployment_id: DeploymentId) -> list[str]:
    """The deployment's waiting jobs, first served first (for tests and diagnostics)."""
    return list(get_redis().zrange(waiting_key(deployment_id), 0, -1))


# --- the model's queue wait (read by the replica autoscaler) --------------------------------------


def queue_wait_record(
    *, model_id: ModelId, seconds: float, now: float | datetime | None = None
) -> float:
    """Fold one waiter's time in the queue into the model's EWMA; returns the new EWMA."""
    t = _now(now)
    args = [
        repr(max(0.0, float(seconds))),
        repr(t),
        WAIT_EWMA_ALPHA,
        WAIT_HALF_LIFE_SECONDS,
        MODEL_WAIT_TTL_SECONDS,
    ]
    return float(_script(_WAIT_RECORD_LUA)(keys=[model_wait_key(model_id)], args=args))


async def _aqueue_wait_record(*, model_id: ModelId, seconds: float) -> None:
    t = time.time()
    args = [
        repr(max(0.0, float(seconds))),
        repr(t),
        WAIT_EWMA_ALPHA,
        WAIT_HALF_LIFE_SECONDS,
        MODEL_WAIT_TTL_SECONDS,
    ]
    await _script(_WAIT_RECORD_LUA, asynchronous=True)(keys=[model_wait_key(model_id)], args=args)


def model_queue_wait(model_id: ModelId, *, now: float | datetime | None = None) -> float:
    """Seconds a request of this model recently waited for a slot (EWMA, decaying while nobody waits)."""
    ewma, updated = get_redis().hmget(model_wait_key(model_id), ["ewma", "updated"])
    if ewma is None or updated is None:
        return 0.0
    age = max(0.0, _now(now) - float(updated))
    return float(ewma) * 0.5 ** (age / WAIT_HALF_LIFE_SECONDS)


def model_last_queued(model_id: ModelId) -> float | None:
    """Unix time someone last joined a queue of this model, or None."""
    raw = get_redis().hget(model_wait_key(model_id), "last_queued")
    return float(raw) if raw is not None else None


def model_queue_depth(model_id: ModelId, *, now: float | datetime | None = None) -> int:
    """Live waiters over every active deployment of the model."""
    dep_ids = Deployment.objects.filter(
        model_id=model_id, state__in=list(DEPLOYMENT_ACTIVE)
    ).values_list("id", flat=True)
    return sum(queue_depth(dep_ids, now=now).values())


# --- waiting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DeploymentRow:
    state: str
    n_parallel: int
    error: str


def _deployment_row(deployment_id: DeploymentId) -> _DeploymentRow | None:
    row = Deployment.objects.filter(pk=deployment_id).values("state", "n_parallel", "error").first()
    return (
        _DeploymentRow(row["state"], int(row["n_parallel"] or 1), row["error"] or "")
        if row
        else None
    )


_background: set[asyncio.Task[Any]] = set()


async def _shielded(coro: Any) -> None:
    """Run ``coro`` to the end even if the awaiting task is cancelled again meanwhile."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        pass  # the task goes on by itself; the caller's own exception keeps propagating
    except Exception:  # cleanup is best effort; leases bound what it leaves
        log.warning("admission cleanup failed; the lease sweep will reclaim it", exc_info=True)


async def wait_for_slot(
    *,
    deployment_id: DeploymentId,
    job_id: JobId,
    priority: float | Callable[[], float],
    model_id: ModelId | None = None,
    queued_at: float | None = None,
    load_timeout: float,
    slot_timeout: float,
) -> None:
    """Wait for the deployment to serve and for a slot; return holding it.

    Raises DeploymentUnavailable, QueueFull or WaitTimedOut. ``priority`` (lower first) may be a
    callable, computed only if the request has to queue. ``load_timeout`` bounds the whole wait,
    ``slot_timeout`` the part after the deployment is READY. Whatever ends the wait (a slot, an
    error, a time-out, or the task being cancelled when the client goes away), the queue entry is
    gone when this returns or raises; a slot is held only on a normal return.
    """
    dep_id, job = DeploymentId(str(deployment_id)), JobId(str(job_id))
    start = time.monotonic()
    queued_wall = time.time() if queued_at is None else float(queued_at)
    deadline = start + load_timeout
    slot_deadline: float | None = None
    joined = acquired = False
    dep: _DeploymentRow | None = None
    dep_checked = float("-inf")
    delay = 0.01
    score = 0.0
    try:
        while True:
            now_m = time.monotonic()
            if now_m - dep_checked >= 1.0:
                dep = await sync_to_async(_deployment_row)(dep_id)
                dep_checked = now_m
                if dep is None:
                    raise DeploymentUnavailable("deployment vanished")
                if dep.state in DEPLOYMENT_ENDED:
                    raise DeploymentUnavailable(dep.error or f"deployment {dep.state.lower()}")
            assert dep is not None
            serving = dep.state in DEPLOYMENT_SERVING
            taken = -1
            if serving:
                if slot_deadline is None:
                    slot_deadline = now_m + slot_timeout
                taken = await _aslot_take(deployment_id=dep_id, job_id=job, cap=dep.n_parallel)
                if taken == 1:
                    acquired = True
                    return
            if not joined:
                score = (await sync_to_async(priority)()) if callable(priority) else float(priority)
                joined = True  # before the await: a cancel during it may land after Redis joined us
                if not await aqueue_join(
                    deployment_id=dep_id, job_id=job, priority=score, model_id=model_id
                ):
                    joined = False
                    raise QueueFull(f"{settings.JOB_QUEUE_MAX} requests are already waiting")
                continue  # at the head now, perhaps: try again without sleeping
            if taken == -1:
                # Not serving yet (the take script renews a ready deployment's waiters), or our
                # entry lapsed while this loop was starved: renew or rejoin at the same score.
                if not await aqueue_join(
                    deployment_id=dep_id, job_id=job, priority=score, model_id=model_id
                ):
                    raise QueueFull(f"{settings.JOB_QUEUE_MAX} requests are already waiting")
            if now_m > deadline or (slot_deadline is not None and now_m > slot_deadline):
                raise WaitTimedOut("timed out waiting for capacity")
            await asyncio.sleep(delay)
            delay = min(WAIT_POLL_MAX_SECONDS, delay * 1.5)
    finally:
        if not acquired:
            await _shielded(aslot_release(deployment_id=dep_id, job_id=job))
        if joined and model_id is not None:
            await _shielded(
                _aqueue_wait_record(model_id=model_id, seconds=time.time() - queued_wall)
            )


# --- the sweep -------------------------------------------------------------------------------------


def _finished_jobs(job_ids: Iterable[str]) -> set[str]:
    """Those of these ids whose job is terminal in the database (ids that are not UUIDs: none)."""
    valid = []
    for j in job_ids:
        try:
            valid.append(uuid.UUID(j))
        except ValueError:
            continue
    if not valid:
        return set()
    return {
        str(pk)
        for pk in Job.objects.filter(pk__in=valid, state__in=list(JOB_TERMINAL)).values_list(
            "id", flat=True
        )
    }


def admission_sweep(*, now: float | datetime) -> dict[str, int]:
    """Reclaim what crashed views left: expired slot leases, slots of finished jobs, lapsed waiters."""
    t = _now(now)
    r = get_redis()
    counts = {"slots_expired": 0, "slots_finished": 0, "waiters_dropped": 0}
    for key in list(r.scan_iter(match="racon:dep:*:slots", count=500)):
        counts["slots_expired"] += int(r.zremrangebyscore(key, "-inf", t))
        finished = _finished_jobs(r.zrange(key, 0, -1))
        if finished:
            counts["slots_finished"] += int(r.zrem(key, *finished))
    dep_ids = {k.split(":")[2] for k in r.scan_iter(match="racon:dep:*:waiting", count=500)}
    dep_ids |= {k.split(":")[2] for k in r.scan_iter(match="racon:dep:*:waitlease", count=500)}
    sweep = _script(_SWEEP_QUEUE_LUA)
    for dep_id in dep_ids:
        finished = _finished_jobs(r.zrange(waiting_key(dep_id), 0, -1))
        counts["waiters_dropped"] += int(
            sweep(
                keys=[waiting_key(dep_id), waitlease_key(dep_id)], args=[repr(t), *sorted(finished)]
            )
        )
    if any(counts.values()):
        log.info("admission sweep reclaimed %s", counts)
    return counts
