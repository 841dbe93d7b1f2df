"""The KV cache coordinator: which replica and slot holds each conversation's prefix, and routing
that weighs a cached prefix against load (docs/design/serving.md, "KV cache coordinator").

- **Prefixes.** A request's prefix chain is a hash chain over its messages: ``h0`` hashes what
  shapes the prompt besides the messages (model, kind, tools, schema), ``h_k = H(h_{k-1}, m_k)``
  (a message in a canonical JSON form). A follow-up turn's chain repeats the earlier turn's hashes,
  so the longest hash of a request found in the record names the slot holding most of its prompt.
- **Ownership.** When a job finishes, the slot that served it holds the job's messages and its
  completion: the record says so under the chain's last hash (``racon:kv:owners``), with the slot's
  token count, and the slot's own entry (``racon:kv:dep:{dep}:slots``) names that hash. A slot
  holds one sequence: a new one replaces the slot's old entry (a displacement, counted). Entries
  have a TTL, an LRU order (``racon:kv:lru``) and a bound (``KV_PREFIX_MAX_ENTRIES``); evictions
  beyond it are an event (one per pass). The controller pins each job to a slot (``id_slot`` in
  run_job) and records which slots are busy (``racon:kv:dep:{dep}:busy``), so a miss takes the
  least recently used free slot and never one a hit is about to use. A request whose owner slot
  is busy takes a free slot holding a copy of its prefix first (the same messages served twice
  at once leave two copies, and the owner record names the later).
- **Routing.** ``score = tokens saved − λ · (slots used + waiters) / slots`` per serving replica
  (λ = ``KV_ROUTE_LOAD_TOKENS``), as the SGLang and llm-d routers weigh prefix and load. The owner
  wins while its prefix is worth more than its queue; when it has no free slot the request waits
  for it at most ``KV_AFFINITY_WAIT_SECONDS``, then goes to the best other replica, and ownership
  moves with it (KV_OWNERSHIP_MOVED). A draining owner's conversations move with their state
  (kvtransfer.py: slot save, upload, download, restore; KV_STATE_MOVED), and a turn waits for
  that move; an owner that no longer serves with no move under way (stopped, failed, or a move
  that failed) loses its records with KV_STATE_DROPPED: the new owner prefills again.
- ``racon:kv:routing`` (or the ``KV_ROUTING`` setting) picks the policy: ``prefix`` (default),
  ``round_robin`` or ``least_loaded`` (the earlier free-share ranking); the last two pin no slot
  and leave the slot to llama-server's own prompt cache (the benchmark's baseline).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings
from django.utils import timezone

from agent.protocol import kv_held_key
from apps.models_repo.profile import ModelProfile
from apps.nodes.events import event_record
from apps.nodes.models import EventCategory
from racon.ids import DeploymentId, JobId, ModelId
from racon.redis import get_redis

from . import admission, selectors
from .states import DeploymentState

log = logging.getLogger("racon.jobs.kvcache")

OWNERS_KEY = "racon:kv:owners"  # HASH prefix hash → "dep|slot|tokens"
LRU_KEY = "racon:kv:lru"  # ZSET prefix hash → last use (unix s)
STATS_KEY = "racon:kv:stats"  # HASH counters read by /metrics
ROUTING_KEY = "racon:kv:routing"  # STRING: overrides settings.KV_ROUTING
POLICIES = ("prefix", "round_robin", "least_loaded")
# The stats counters /metrics reads (apps/api/metrics.py).
STAT_FIELDS = (
    "hits",
    "misses",
    "tokens_saved",
    "moved",
    "evicted",
    "displaced",
    "dropped",
    "bytes_moved",
    "transfer_seconds",
    "transferred",
)


def dep_slots_key(deployment_id: DeploymentId) -> str:
    """HASH slot → "prefix|tokens|last use": what each slot of the deployment holds."""
    return f"racon:kv:dep:{deployment_id}:slots"


def dep_busy_key(deployment_id: DeploymentId) -> str:
    """HASH slot → job id: slots pinned by a job in flight."""
    return f"racon:kv:dep:{deployment_id}:busy"


def rr_key(model_id: ModelId) -> str:
    return f"racon:kv:rr:{model_id}"


TRANSFER_SWITCH_KEY = "racon:kv:transfer"  # STRING "on"/"off": overrides settings.KV_TRANSFER
# HASH prefix hash → the deployment whose dropped state held it (deployment_drop): the turn that
# follows records KV_OWNERSHIP_MOVED from there whether the drop came before its routing or after.
DROPPED_KEY = "racon:kv:dropped"
# A busy entry held by a state transfer, not a job: "kv-move:{transfer}:{expiry unix s}".
MOVE_HOLDER = "kv-move:"


def transfer_state_key(deployment_id: DeploymentId) -> str:
    """STRING "moving" while the deployment's conversations are being moved off it, then "done"."""
    return f"racon:kv:dep:{deployment_id}:transfer"


# --- the hash chain -------------------------------------------------------------------------------

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def _digest(prev: str, part: Any) -> str:
    raw = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(f"{prev}\x00{raw}".encode()).hexdigest()[:32]


def message_canonical(message: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that render into the prompt; empty ones (None, "", []) dropped, so
    ``{"content": "x", "tool_calls": []}`` hashes as ``{"content": "x"}``."""
    return {k: message[k] for k in _MESSAGE_KEYS if message.get(k) not in (None, "", [], {})}


def prefix_chain(*, model_id: ModelId, kind: str, params: dict[str, Any]) -> list[str]:
    """The request's hash chain, one hash per message boundary (a completion's prompt: one)."""
    root = _digest(
        "racon-kv-1",
        {
            "model": str(model_id),
            "kind": kind,
            "tools": params.get("tools"),
            "tool_mode": params.get("tool_mode"),
            "json_schema": params.get("json_schema"),
        },
    )
    if kind != "chat":
        prompt = params.get("prompt")
        return [_digest(root, prompt)] if isinstance(prompt, str) and prompt else []
    chain: list[str] = []
    h = root
    for m in params.get("messages") or []:
        if not isinstance(m, dict):
            return chain
        h = _digest(h, message_canonical(m))
        chain.append(h)
    return chain


# --- the routing score ----------------------------------------------------------------------------


def route_score(
    *, tokens_saved: int, used: int, waiting: int, n_parallel: int, lam: float
) -> float:
    """Tokens of prefill a replica saves, less λ tokens per unit of queue/slot pressure."""
    return float(tokens_saved) - lam * (used + waiting) / max(1, n_parallel)


@dataclass
class Owner:
    deployment_id: DeploymentId
    slot: int
    tokens: int
    prefix: str
    depth: int  # how many of the request's messages the prefix covers


@dataclass
class Route:
    """The routing decision for one request, kept on its Admission until the job ends."""

    deployment: Any  # a Deployment, or None (the model has none serving)
    policy: str
    reason: str
    chain: list[str] = field(default_factory=list)
    owner: Owner | None = None  # the longest recorded prefix, wherever it is
    hit: bool = False  # routed to the owner (its slot is pinned when free)
    tokens_saved: int = 0
    affinity_wait: float = 0.0  # the owner is full: wait this long for it, then the fallback
    fallback: Any = None  # the best other replica
    slot: int | None = None  # the slot claimed for the job (slot_claim)
    slot_deployment_id: str | None = None
    scores: dict[str, float] = field(default_factory=dict)


def _policy_of(override: Any) -> str:
    """The policy in force: the operator's override (ROUTING_KEY) when set, else KV_ROUTING."""
    policy = str(override or settings.KV_ROUTING)
    return policy if policy in POLICIES else "prefix"


def owner_lookup(chain: Sequence[str]) -> Owner | None:
    """The longest prefix of ``chain`` whose slot still holds it."""
    if not chain:
        return None
    return _owner_verified(chain, get_redis().hmget(OWNERS_KEY, list(chain)))


def _owner_verified(chain: Sequence[str], raw: Sequence[Any]) -> Owner | None:
    """owner_lookup's second half: of the owner records ``raw`` (the HMGET of ``chain``), the
    deepest whose slot still holds its prefix (one HGET per record tried)."""
    r = get_redis()
    for depth in range(len(chain), 0, -1):
        value = raw[depth - 1]
        if not value:
            continue
        try:
            dep_s, slot_s, tokens_s = str(value).split("|")
            dep, slot = DeploymentId(dep_s), int(slot_s)
        except ValueError:
            continue
        held = r.hget(dep_slots_key(dep), str(slot))
        if held and str(held).split("|")[0] == chain[depth - 1]:
            return Owner(
                deployment_id=dep,
                slot=slot,
                tokens=int(tokens_s),
                prefix=chain[depth - 1],
                depth=depth,
            )
    return None


def route_request(
    *, model_id: ModelId, kind: str, params: dict[str, Any], cached: bool = True
) -> Route:
    """Choose a serving replica for this request by the routing policy, and say why.

    The policy override, the candidates' dead marks, slot leases and waiters, and the prefix's
    owner records are read in one pipelined round trip (admission.loads_queue): on a machine
    whose cores the engine keeps busy, each round trip to Redis waits for Redis to be scheduled,
    and a burst of requests queues behind those waits."""
    listed = selectors.deployment_route_candidates(model_id=model_id, cached=cached)
    chain = prefix_chain(model_id=model_id, kind=kind, params=params)
    with get_redis().pipeline(transaction=False) as pipe:
        pipe.get(ROUTING_KEY)
        loads_read = admission.loads_queue(pipe, [str(d.id) for d in listed])
        if chain:
            pipe.hmget(OWNERS_KEY, list(chain))
        results = iter(pipe.execute())
    policy = _policy_of(next(results))
    loads = loads_read(results)
    owners_raw = next(results) if chain else []
    candidates = [d for d in listed if str(d.id) not in loads.dead]
    if policy != "prefix":
        chain = []
    if not candidates:
        return Route(deployment=None, policy=policy, reason="no serving replica", chain=chain)
    if policy == "least_loaded" or len(candidates) == 1 and not chain:
        return Route(
            deployment=selectors.deployment_rank(candidates, used=loads.used),
            policy=policy,
            reason="least loaded",
        )
    ids = [str(d.id) for d in candidates]
    if policy == "round_robin":
        n = int(get_redis().incr(rr_key(model_id)))
        dep = sorted(candidates, key=lambda d: str(d.id))[(n - 1) % len(candidates)]
        return Route(deployment=dep, policy=policy, reason="round robin")
    used, waiting = loads.used, loads.waiting
    owner = _owner_verified(chain, owners_raw) if chain else None
    if owner is not None and owner.deployment_id not in ids:
        owner = _await_transfer(chain=chain, owner=owner)
    lowered = ""
    if owner is not None:
        owner, lowered = engine_claim_lowered(owner, candidates)
    lam = float(settings.KV_ROUTE_LOAD_TOKENS)
    scores: dict[str, float] = {}
    for d in candidates:
        did = str(d.id)
        saved = owner.tokens if owner is not None and owner.deployment_id == did else 0
        scores[did] = route_score(
            tokens_saved=saved,
            used=used.get(did, 0),
            waiting=waiting.get(did, 0),
            n_parallel=int(d.n_parallel or 1),
            lam=lam,
        )
    # Highest score; then the most free slots; stable on the id so equal replicas alternate by load.
    ranked = sorted(
        candidates,
        key=lambda d: (
            d.state != DeploymentState.READY,
            -scores[str(d.id)],
            -(int(d.n_parallel or 1) - used.get(str(d.id), 0)),
            str(d.id),
        ),
    )
    best = ranked[0]
    route = Route(
        deployment=best, policy=policy, reason="", chain=chain, owner=owner, scores=scores
    )
    if owner is None:
        route.reason = lowered or ("miss: no cached prefix" if chain else "no prefix")
    elif owner.deployment_id not in ids:
        route.reason = f"owner {owner.deployment_id} no longer serves: state dropped"
        deployment_drop(deployment_id=owner.deployment_id, reason="the replica no longer serves")
        # route.owner stays: the job's end records the move (KV_OWNERSHIP_MOVED) to the new owner
    elif str(best.id) == owner.deployment_id:
        route.hit, route.tokens_saved = True, owner.tokens
        full = used.get(owner.deployment_id, 0) >= int(best.n_parallel or 1)
        route.reason = f"hit: {owner.tokens} tokens cached on slot {owner.slot}{lowered}"
        if full and len(ranked) > 1:
            route.affinity_wait = float(settings.KV_AFFINITY_WAIT_SECONDS)
            route.fallback = ranked[1]
            route.reason += f", owner full: wait ≤ {route.affinity_wait:g}s"
    else:
        route.reason = (
            f"owner {owner.deployment_id} outscored ({scores[owner.deployment_id]:.0f} < "
            f"{scores[str(best.id)]:.0f}): load outweighs {owner.tokens} cached tokens"
        )
    log.debug(
        "kv route %s → %s (%s); scores %s",
        chain[-1][:12] if chain else "-",
        best.id,
        route.reason,
        {k[:8]: round(v, 1) for k, v in scores.items()},
    )
    return route


def engine_claim_lowered(owner: Owner, candidates: Sequence[Any]) -> tuple[Owner | None, str]:
    """The owner as its node's engine reports it (issue 30): a vLLM primary's KV-cache events say
    how many tokens each slot still holds (agent/protocol.py kv_held_key). A node's claim: it may
    lower the controller's record (evicted blocks), never raise it. No report: the record stands.
    Returns the owner (None when nothing is left) and a note for the route's reason."""
    dep = next((d for d in candidates if str(d.id) == owner.deployment_id), None)
    if dep is None or getattr(dep, "engine", "llamacpp") != "vllm" or not dep.primary_id:
        return owner, ""
    raw = get_redis().get(kv_held_key(str(dep.primary_id), str(dep.id)))
    try:
        held = int(json.loads(raw)[str(owner.slot)]) if raw else None
    except (ValueError, TypeError, KeyError):
        held = None
    if held is None or held >= owner.tokens:
        return owner, "" if held is None else " (vLLM's KV events confirm)"
    if held <= 0:
        return None, f"miss: vLLM's KV events say slot {owner.slot} no longer holds the prefix"
    return dataclasses.replace(owner, tokens=held), f" (lowered to {held} by vLLM's KV events)"


def _await_transfer(*, chain: Sequence[str], owner: Owner) -> Owner | None:
    """The owner no longer serves: while its conversations are being moved off it (a drain's state
    transfer), wait at most KV_TRANSFER_WAIT_SECONDS for the move, then look the prefix up again."""
    r = get_redis()
    key = transfer_state_key(owner.deployment_id)
    deadline = time.monotonic() + float(settings.KV_TRANSFER_WAIT_SECONDS)
    waited = False
    while r.get(key) == "moving" and time.monotonic() < deadline:
        waited = True
        time.sleep(0.05)
    if not waited:
        return owner
    found = owner_lookup(chain)
    log.debug("kv route waited for the transfer off %s: now %s", owner.deployment_id, found)
    return found if found is not None else owner


def route_fallback(*, route: Route) -> Any:
    """The affinity wait ran out: the best other replica (ownership moves with the job)."""
    route.hit, route.tokens_saved = False, 0
    route.reason = "owner busy past the affinity wait: moved"
    route.deployment = route.fallback
    log.debug("kv route fallback → %s", getattr(route.fallback, "id", None))
    return route.fallback


# --- slots ----------------------------------------------------------------------------------------

_RELEASE_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def slot_claim(
    *, route: Route | None, deployment_id: DeploymentId, job_id: JobId, n_parallel: int
) -> int | None:
    """Pin the job to a slot of the deployment: the owner's when this is a hit and it is free; else
    a free slot that holds a copy of the request's prefix (the deepest: two requests with the same
    messages served at once each leave one, and the owner record names only the last); else the
    least recently used free one (an empty one first). None for a policy that pins nothing."""
    if route is None or route.policy != "prefix":
        return None
    dep = DeploymentId(str(deployment_id))
    n = max(1, int(n_parallel))
    r = get_redis()
    now = time.time()
    busy, live_jobs, last_use, held = _slot_view(r, dep, now)
    stale = [
        s
        for s, j in busy.items()
        if str(j) not in live_jobs and str(j) != str(job_id) and not _move_holds(str(j), now)
    ]
    if stale:
        r.hdel(dep_busy_key(dep), *stale)
    taken = {int(s) for s, j in busy.items() if s not in stale}
    want = route.owner.slot if route.hit and route.owner is not None else None
    if want is not None and str(route.owner.deployment_id if route.owner else "") != dep:
        want = None
    order = [want] if want is not None and want < n and want not in taken else []
    depth = {c: i + 1 for i, c in enumerate(route.chain)}
    copies: dict[int, tuple[int, int]] = {}  # free slot → (depth of its prefix, its tokens)
    for s, v in held.items():
        prefix, tokens = (str(v).split("|") + ["0"])[:2]
        if prefix in depth and s.isdigit() and int(s) < n and int(s) not in taken:
            copies[int(s)] = (depth[prefix], int(tokens or 0))
    order += sorted((s for s in copies if s != want), key=lambda s: -copies[s][0])
    order += sorted(
        (s for s in range(n) if s not in taken and s != want and s not in copies), key=last_use
    )
    ttl = int(settings.KV_PREFIX_TTL_SECONDS)
    for slot in order:
        with r.pipeline(transaction=False) as pipe:  # the pin and the key's lifetime: one trip
            pipe.hsetnx(dep_busy_key(dep), str(slot), str(job_id))
            pipe.expire(dep_busy_key(dep), ttl)
            pinned = pipe.execute()[0]
        if pinned:
            if slot in copies and slot != want:
                was = "owner slot busy" if want is not None else "no owner record"
                route.hit, route.tokens_saved = True, copies[slot][1]
                route.reason += f"; {was}: a copy of the prefix on slot {slot}"
            elif slot != want and want is not None:
                route.hit, route.tokens_saved = False, 0  # the owner's slot was taken meanwhile
                route.reason += "; owner slot busy"
            route.slot, route.slot_deployment_id = slot, dep
            return slot
    return None  # every slot is pinned (leases out of step): llama-server picks


def _slot_view(
    r: redis.Redis, dep: DeploymentId, now: float
) -> tuple[dict[Any, Any], set[str], Callable[[int], float], dict[Any, Any]]:
    """One read of the deployment's slots: the busy pins (slot → holder), the jobs whose admission
    slot is live at ``now``, each slot's last use from its ownership record (0.0 for a slot
    holding nothing, so sorting by it puts empty slots first, then the least recently used), and
    the records themselves (slot → "prefix|tokens|last use")."""
    with r.pipeline(transaction=False) as pipe:
        pipe.hgetall(dep_busy_key(dep))
        pipe.hgetall(dep_slots_key(dep))
        pipe.zrangebyscore(admission.slots_key(dep), f"({now!r}", "+inf")
        busy, held, live = pipe.execute()

    def last_use(slot: int) -> float:
        v = held.get(str(slot))
        return float(str(v).split("|")[2]) if v else 0.0

    return busy, {str(j) for j in live}, last_use, held


def _move_holds(holder: str, now: float) -> bool:
    """Whether a busy entry is a state transfer's reservation that has not expired."""
    if not holder.startswith(MOVE_HOLDER):
        return False
    try:
        return float(holder.rsplit(":", 1)[1]) > now
    except ValueError:
        return False


def slot_reserve(
    *, deployment_id: DeploymentId, n_parallel: int, transfer_id: str, ttl: float
) -> int | None:
    """Pin a free slot of the deployment for a state restore (the least recently used, an empty one
    first), as a job would be pinned: no job is given it until slot_unreserve. None: all busy."""
    dep = DeploymentId(str(deployment_id))
    r = get_redis()
    now = time.time()
    busy, live_jobs, last_use, _ = _slot_view(r, dep, now)
    taken = {int(s) for s, j in busy.items() if str(j) in live_jobs or _move_holds(str(j), now)}
    holder = f"{MOVE_HOLDER}{transfer_id}:{now + ttl!r}"
    for slot in sorted((s for s in range(max(1, int(n_parallel))) if s not in taken), key=last_use):
        stale = busy.get(str(slot))
        if stale is not None:  # a dead job's pin: take it over only if it is still that one
            if r.eval(_RELEASE_LUA, 1, dep_busy_key(dep), str(slot), str(stale)) != 1:
                continue
        if r.hsetnx(dep_busy_key(dep), str(slot), holder):
            r.expire(dep_busy_key(dep), int(settings.KV_PREFIX_TTL_SECONDS))
            return slot
    return None


def slot_unreserve(*, deployment_id: DeploymentId, slot: int, transfer_id: str) -> None:
    r = get_redis()
    key = dep_busy_key(deployment_id)
    held = r.hget(key, str(slot))
    if held and str(held).startswith(f"{MOVE_HOLDER}{transfer_id}:"):
        r.eval(_RELEASE_LUA, 1, key, str(slot), str(held))


def slot_release(*, route: Route | None, job_id: JobId, pipe: Any = None) -> bool:
    """Unpin the job's slot, if it pinned one (True then); with ``pipe``, the release is queued
    on that pipeline, in the caller's round trip."""
    if route is None or route.slot is None or route.slot_deployment_id is None:
        return False
    (pipe if pipe is not None else get_redis()).eval(
        _RELEASE_LUA,
        1,
        dep_busy_key(DeploymentId(route.slot_deployment_id)),
        str(route.slot),
        str(job_id),
    )
    return True


# --- recording ------------------------------------------------------------------------------------


def _stats_add(pipe: Any, **counts: float) -> None:
    for name, value in counts.items():
        if value:
            if isinstance(value, float) and not value.is_integer():
                pipe.hincrbyfloat(STATS_KEY, name, value)
            else:
                pipe.hincrby(STATS_KEY, name, int(value))


def _forget(r: Any, prefixes: Iterable[str]) -> int:
    """Drop these prefixes from the record (and their slots' entries, when they still match)."""
    gone = 0
    for p in prefixes:
        value = r.hget(OWNERS_KEY, p)
        if value:
            dep_s, slot = str(value).split("|")[:2]
            dep = DeploymentId(dep_s)
            held = r.hget(dep_slots_key(dep), slot)
            if held and str(held).split("|")[0] == p:
                r.hdel(dep_slots_key(dep), slot)
            gone += 1
        r.hdel(OWNERS_KEY, p)
        r.zrem(LRU_KEY, p)
    return gone


def job_finished(
    *,
    route: Route | None,
    job_id: JobId,
    deployment_id: DeploymentId | None,
    completed: bool,
    usage: dict[str, Any],
    served_slot: int | None,
) -> None:
    """The job ended: free its pinned slot; when it completed, record that the slot that served it
    holds its messages and completion (ownership), and count the hit or miss."""
    if route is None:
        return
    dep = DeploymentId(str(deployment_id))
    slot = served_slot if served_slot is not None else route.slot
    if (
        not completed
        or route.policy != "prefix"
        or not route.chain
        or slot is None
        or (served_slot is None and route.slot_deployment_id != dep)
    ):
        slot_release(route=route, job_id=job_id)
        return
    r = get_redis()
    now = time.time()
    prefix = route.chain[-1]
    tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    ttl = int(settings.KV_PREFIX_TTL_SECONDS)
    owner = route.owner
    # A miss with history may follow a drop (DROPPED_KEY): read in the slot's round trip.
    earlier = list(route.chain[:-1]) if owner is None else []
    with r.pipeline(transaction=False) as read:  # the pin's release rides along
        pinned = slot_release(route=route, job_id=job_id, pipe=read)
        read.hget(dep_slots_key(dep), str(slot))
        if earlier:
            read.hmget(DROPPED_KEY, earlier)
        got = read.execute()
    old, *dropped = got[1:] if pinned else got
    old_prefix = str(old).split("|")[0] if old else None
    moved_from: str | None = None
    displaced = 0
    if (
        old_prefix
        and old_prefix not in route.chain
        and (owner is None or old_prefix != owner.prefix)
    ):
        displaced = 1  # another conversation's state in this slot was overwritten
    forget = [old_prefix] if old_prefix and old_prefix != prefix else []
    if owner is not None and owner.prefix != prefix:
        forget.append(owner.prefix)  # the conversation's older prefix, here or on its old owner
        if owner.deployment_id != dep:
            moved_from = owner.deployment_id
    # Its owner's state was dropped before this turn was routed (a drain's own step): the
    # conversation moved all the same, from the deployment the drop names.
    gone = [(p, str(d)) for p, d in zip(earlier, dropped[0] if dropped else [], strict=False) if d]
    if gone and gone[-1][1] != dep:
        moved_from = gone[-1][1]
    _forget(r, forget)
    with r.pipeline(transaction=False) as pipe:
        if gone:
            pipe.hdel(DROPPED_KEY, *(p for p, _ in gone))  # told once
        pipe.hset(OWNERS_KEY, prefix, f"{dep}|{slot}|{tokens}")
        pipe.zadd(LRU_KEY, {prefix: now})
        pipe.hset(dep_slots_key(dep), str(slot), f"{prefix}|{tokens}|{now!r}")
        for key in (OWNERS_KEY, LRU_KEY, dep_slots_key(dep)):
            pipe.expire(key, ttl)
        _stats_add(
            pipe,
            hits=1 if route.hit else 0,
            misses=0 if route.hit else 1,
            tokens_saved=int(usage.get("prompt_cached") or 0) if route.hit else 0,
            displaced=displaced,
            moved=1 if moved_from else 0,
        )
        pipe.execute()
    if moved_from:
        event_record(
            kind="KV_OWNERSHIP_MOVED",
            category=EventCategory.INFERENCE,
            now=timezone.now(),
            deployment_id=dep,
            message=f"conversation prefix moved from deployment {moved_from} to slot {slot}",
            data={
                "job": str(job_id),
                "from_deployment": moved_from,
                "from_slot": owner.slot if owner else None,
                "to_deployment": dep,
                "to_slot": slot,
                "tokens": tokens,
                "reason": route.reason,
            },
        )
    prune(now=now)


def prune(*, now: float | None = None) -> int:
    """Drop entries past the TTL, then the least recently used beyond KV_PREFIX_MAX_ENTRIES
    (one KV_OWNERSHIP_EVICTED event per pass that evicted any)."""
    r = get_redis()
    now = time.time() if now is None else now
    with r.pipeline(transaction=False) as pipe:  # one round trip on every job's end
        pipe.zrangebyscore(LRU_KEY, "-inf", now - settings.KV_PREFIX_TTL_SECONDS)
        pipe.zcard(LRU_KEY)
        listed, count = pipe.execute()
    expired = [str(p) for p in listed]
    if expired:
        _forget(r, expired)  # each was in LRU_KEY, which _forget leaves without it
    excess = int(count) - len(expired) - int(settings.KV_PREFIX_MAX_ENTRIES)
    if excess <= 0:
        return len(expired)
    victims = [str(p) for p in r.zrange(LRU_KEY, 0, excess - 1)]
    _forget(r, victims)
    r.hincrby(STATS_KEY, "evicted", len(victims))
    event_record(
        kind="KV_OWNERSHIP_EVICTED",
        category=EventCategory.INFERENCE,
        now=timezone.now(),
        message=f"{len(victims)} least recently used prefixes evicted "
        f"(bound KV_PREFIX_MAX_ENTRIES={settings.KV_PREFIX_MAX_ENTRIES})",
        data={"count": len(victims), "max_entries": int(settings.KV_PREFIX_MAX_ENTRIES)},
    )
    return len(expired) + len(victims)


def deployment_drop(*, deployment_id: DeploymentId, reason: str) -> int:
    """Forget every prefix a deployment's slots hold, with one KV_STATE_DROPPED event saying so
    (what was not moved by a state transfer prefills again where it goes next)."""
    r = get_redis()
    dep = DeploymentId(str(deployment_id))
    held = r.hgetall(dep_slots_key(dep))
    if not held:
        return 0
    prefixes = [str(v).split("|")[0] for v in held.values()]
    tokens = sum(int(str(v).split("|")[1]) for v in held.values())
    for p in prefixes:
        r.hdel(OWNERS_KEY, p)
        r.zrem(LRU_KEY, p)
    r.hset(DROPPED_KEY, mapping=dict.fromkeys(prefixes, dep))
    r.expire(DROPPED_KEY, int(settings.KV_PREFIX_TTL_SECONDS))
    r.delete(dep_slots_key(dep), dep_busy_key(dep))
    r.hincrby(STATS_KEY, "dropped", len(prefixes))
    event_record(
        kind="KV_STATE_DROPPED",
        category=EventCategory.INFERENCE,
        now=timezone.now(),
        deployment_id=dep,
        message=f"KV state of {len(prefixes)} conversations ({tokens} tokens) dropped: {reason}; "
        "not transferred, the next turn prefills on its new replica",
        data={"conversations": len(prefixes), "tokens": tokens, "reason": reason},
    )
    log.info("kv state of deployment %s dropped (%d conversations): %s", dep, len(prefixes), reason)
    return len(prefixes)


# --- state transfer (apps/jobs/kvtransfer.py moves the bytes) -------------------------------------


def transfer_enabled() -> bool:
    """Whether a drain moves its replicas' conversations (``racon:kv:transfer`` overrides
    ``KV_TRANSFER``)."""
    try:
        override = get_redis().get(TRANSFER_SWITCH_KEY)
    except Exception:  # a switch: Redis trouble falls back to the setting
        override = None
    if override in ("on", "off"):
        return override == "on"
    return bool(settings.KV_TRANSFER)


_BEGIN_LUA = """
if redis.call('GET', KEYS[1]) == 'moving' then return 0 end
redis.call('SET', KEYS[1], 'moving', 'EX', ARGV[1])
return 1
"""


def transfer_begin(*, deployment_id: DeploymentId, ttl: float) -> bool:
    """Mark the deployment's conversations as moving (False while a transfer is under way; a later
    drain may move again). The mark expires, so a lost task never holds a drain up for good."""
    key = transfer_state_key(deployment_id)
    return bool(get_redis().eval(_BEGIN_LUA, 1, key, str(max(1, int(ttl)))))


def transfer_end(*, deployment_id: DeploymentId) -> None:
    get_redis().set(transfer_state_key(deployment_id), "done", ex=3600)


def transfer_state(*, deployment_id: DeploymentId) -> str | None:
    value = get_redis().get(transfer_state_key(deployment_id))
    return str(value) if value else None


@dataclass
class Held:
    """One conversation held in a slot: what a state transfer moves."""

    slot: int
    prefix: str
    tokens: int
    last_use: float


def slots_held(*, deployment_id: DeploymentId) -> list[Held]:
    """The conversations the deployment's slots hold, the most recently used first."""
    out: list[Held] = []
    for slot_s, value in (get_redis().hgetall(dep_slots_key(deployment_id)) or {}).items():
        parts = str(value).split("|")
        try:
            out.append(Held(int(slot_s), parts[0], int(parts[1]), float(parts[2])))
        except (IndexError, ValueError):
            continue
    return sorted(out, key=lambda h: -h.last_use)


def conversation_moved(
    *,
    held: Held,
    from_deployment_id: DeploymentId,
    to_deployment_id: DeploymentId,
    to_slot: int,
    n_bytes: int,
    seconds: float,
    tokens_restored: int,
) -> bool:
    """A conversation's KV state was restored into ``to_slot``: the new owner holds it (one
    KV_STATE_MOVED event, bytes and seconds counted). False, recording nothing, when the old slot
    no longer names the prefix (a job replaced it, or the record was dropped meanwhile)."""
    r = get_redis()
    src, dst = DeploymentId(str(from_deployment_id)), DeploymentId(str(to_deployment_id))
    current = r.hget(dep_slots_key(src), str(held.slot))
    if not current or str(current).split("|")[0] != held.prefix:
        return False
    now = time.time()
    ttl = int(settings.KV_PREFIX_TTL_SECONDS)
    old = r.hget(dep_slots_key(dst), str(to_slot))
    displaced = 0
    if old and str(old).split("|")[0] != held.prefix:
        _forget(r, [str(old).split("|")[0]])
        displaced = 1
    with r.pipeline(transaction=True) as pipe:
        pipe.hdel(dep_slots_key(src), str(held.slot))
        pipe.hset(OWNERS_KEY, held.prefix, f"{dst}|{to_slot}|{held.tokens}")
        pipe.zadd(LRU_KEY, {held.prefix: now})
        pipe.hset(dep_slots_key(dst), str(to_slot), f"{held.prefix}|{held.tokens}|{now!r}")
        for key in (OWNERS_KEY, LRU_KEY, dep_slots_key(dst)):
            pipe.expire(key, ttl)
        _stats_add(
            pipe,
            moved=1,
            displaced=displaced,
            transferred=1,
            bytes_moved=int(n_bytes),
            transfer_seconds=float(seconds),
        )
        pipe.execute()
    event_record(
        kind="KV_STATE_MOVED",
        category=EventCategory.INFERENCE,
        now=timezone.now(),
        deployment_id=dst,
        message=(
            f"KV state of a conversation ({tokens_restored} tokens, {n_bytes} bytes) moved from "
            f"deployment {src} slot {held.slot} to slot {to_slot} in {seconds:.2f}s"
        ),
        data={
            "from_deployment": src,
            "from_slot": held.slot,
            "to_deployment": dst,
            "to_slot": to_slot,
            "tokens": tokens_restored,
            "bytes": int(n_bytes),
            "seconds": round(float(seconds), 4),
        },
    )
    return True


def conversation_drop(*, deployment_id: DeploymentId, held: Held, reason: str) -> bool:
    """Forget one conversation a slot held (its transfer failed), with KV_STATE_DROPPED saying why."""
    r = get_redis()
    dep = DeploymentId(str(deployment_id))
    current = r.hget(dep_slots_key(dep), str(held.slot))
    if not current or str(current).split("|")[0] != held.prefix:
        return False
    _forget(r, [held.prefix])
    r.hincrby(STATS_KEY, "dropped", 1)
    event_record(
        kind="KV_STATE_DROPPED",
        category=EventCategory.INFERENCE,
        now=timezone.now(),
        deployment_id=dep,
        message=f"KV state of a conversation ({held.tokens} tokens, slot {held.slot}) dropped: "
        f"{reason}; the next turn prefills on its new replica",
        data={"conversations": 1, "tokens": held.tokens, "slot": held.slot, "reason": reason},
    )
    log.info("kv state of deployment %s slot %d dropped: %s", dep, held.slot, reason)
    return True


# --- reads (metrics, UI) --------------------------------------------------------------------------


def stats() -> dict[str, float]:
    raw = get_redis().hgetall(STATS_KEY) or {}
    return {name: float(raw.get(name) or 0) for name in STAT_FIELDS}


def deployments_held(deployment_ids: Iterable[Any]) -> dict[str, tuple[int, int]]:
    """Per deployment: (conversations held in its slots, tokens they hold)."""
    ids = [str(d) for d in deployment_ids]
    if not ids:
        return {}
    with get_redis().pipeline(transaction=False) as pipe:
        for d in ids:
            pipe.hvals(dep_slots_key(DeploymentId(d)))
        rows = pipe.execute()
    out: dict[str, tuple[int, int]] = {}
    for d, vals in zip(ids, rows, strict=True):
        tokens = 0
        for v in vals:
            try:
                tokens += int(str(v).split("|")[1])
            except (IndexError, ValueError):
                continue
        out[d] = (len(vals), tokens)
    return out


def kv_bytes_per_token(model_file: Any) -> int:
    """KV bytes one token holds over all layers, from the model file's profile (0 when unknown)."""
    stored = getattr(model_file, "profile", None) if model_file is not None else None
    if not stored:
        return 0
    try:
        # The per-layer figure is a derived one: stored under "derived", recomputed here.
        profile = ModelProfile.from_dict(stored)
    except (KeyError, TypeError, ValueError):
        return 0  # a profile this version cannot read
    n_layer = profile.n_layer or int(getattr(model_file, "n_layer", 0) or 0)
    return profile.kv_bytes_per_token_per_layer * n_layer
