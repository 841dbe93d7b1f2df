"""Per-key and per-account limits on /v1: requests and tokens per minute, and requests at once.

Each limit is a token bucket (capacity = the per-minute figure, refilled continuously at that
figure per 60 s) or a set of requests in flight (a sorted set of job ids with a lease), all kept in
Redis and taken together by one Lua script, so concurrent requests in any number of processes
never pass a limit between a check and a take. A request is admitted only when every limit that
applies has room: one request from its requests bucket, its worst-case tokens (its prompt's
bound plus max_tokens) from its tokens bucket, one place in its in-flight set. Over a limit, the
/v1 view answers 429 in OpenAI's error shape with a ``code`` and ``Retry-After``.

Keys (docs/design/serving.md):
- ``racon:quota:{scope}:{id}:requests`` and ``…:tokens``: HASH level, ts (the bucket).
- ``racon:quota:{scope}:{id}:inflight``: ZSET job → lease expiry; the job's end removes it
  (``quota_release``), a lapsed lease (a crashed view) is dropped by the next take.

Scope is ``key`` (an ApiKey) or ``account``. The figures come from the key's and the account's own
fields (set by the operator: /api/admin/keys/{id}/limits, /api/admin/accounts/{id}/limits, the
admin site), or where a field is empty from the settings RATE_KEY_* and RATE_ACCOUNT_*; 0 is no
limit. The operator's AI_API_KEY has no limits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from apps.accounts.principal import KeyPrincipal
from racon.ids import JobId
from racon.redis import get_redis

# One bucket or set per limit; the script takes all or none.
# KEYS: bucket keys (nb), then in-flight keys (ns).
# ARGV: now, job, lease until, nb, ns, then per bucket capacity and cost, then per set its cap.
# Returns {index of the first limit with no room (1-based over buckets then sets, 0: admitted),
# seconds until that limit has room}.
_TAKE_LUA = """
local now = tonumber(ARGV[1])
local job = ARGV[2]
local lease = tonumber(ARGV[3])
local nb = tonumber(ARGV[4])
local ns = tonumber(ARGV[5])
local levels = {}
for i = 1, nb do
  local cap = tonumber(ARGV[4 + 2 * i])
  local cost = tonumber(ARGV[5 + 2 * i])
  local h = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level = tonumber(h[1])
  local ts = tonumber(h[2])
  if level == nil or ts == nil then
    level = cap
    ts = now
  end
  local rate = cap / 60.0
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  level = math.min(cap, level + elapsed * rate)
  local need = math.min(cost, cap)
  if level < need then
    return {i, tostring((need - level) / rate)}
  end
  levels[i] = level
end
local base = 5 + 2 * nb
for j = 1, ns do
  local k = KEYS[nb + j]
  redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
  if not redis.call('ZSCORE', k, job) and redis.call('ZCARD', k) >= tonumber(ARGV[base + j]) then
    return {nb + j, '1'}
  end
end
for i = 1, nb do
  local cap = tonumber(ARGV[4 + 2 * i])
  local cost = tonumber(ARGV[5 + 2 * i])
  local level = levels[i] - cost
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[i], math.ceil((cap - level) / (cap / 60.0)) + 1)
end
for j = 1, ns do
  redis.call('ZADD', KEYS[nb + j], lease, job)
  redis.call('EXPIRE', KEYS[nb + j], math.ceil(lease - now) + 1)
end
return {0, '0'}
"""

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_scripts: dict[int, Any] = {}


class QuotaExceeded(Exception):
    """A request over one of its key's or account's limits (the view answers 429)."""

    def __init__(self, *, scope: str, limit: str, figure: int, retry_after: float) -> None:
        self.scope = scope  # "key" or "account"
        self.limit = limit  # one of LIMIT_FIELDS
        self.figure = figure
        self.retry_after = max(1, math.ceil(retry_after))
        what = {
            "requests_per_minute": f"{figure} requests per minute",
            "tokens_per_minute": f"{figure} tokens per minute",
            "max_concurrent": f"{figure} requests at once",
        }[limit]
        super().__init__(
            f"Rate limit reached for this {'API key' if scope == 'key' else 'account'}: "
            f"{what}. Please try again in {self.retry_after}s."
        )

    @property
    def code(self) -> str:
        return (
            "concurrency_limit_exceeded"
            if self.limit == "max_concurrent"
            else ("rate_limit_exceeded")
        )

    @property
    def type(self) -> str:
        return "tokens" if self.limit == "tokens_per_minute" else "requests"


@dataclass(frozen=True)
class _Limit:
    scope: str
    owner: str
    field: str
    figure: int
    cost: int = 0


def effective_limits(principal: KeyPrincipal) -> dict[str, dict[str, int]]:
    """The figures that apply to a key: {"key": {field: n}, "account": {field: n}} (0: none)."""
    defaults = {
        "key": {
            "requests_per_minute": settings.RATE_KEY_REQUESTS_PER_MINUTE,
            "tokens_per_minute": settings.RATE_KEY_TOKENS_PER_MINUTE,
            "max_concurrent": settings.RATE_KEY_MAX_CONCURRENT,
        },
        "account": {
            "requests_per_minute": settings.RATE_ACCOUNT_REQUESTS_PER_MINUTE,
            "tokens_per_minute": settings.RATE_ACCOUNT_TOKENS_PER_MINUTE,
            "max_concurrent": settings.RATE_ACCOUNT_MAX_CONCURRENT,
        },
    }
    own = {"key": principal.key_limits, "account": principal.account_limits}
    out: dict[str, dict[str, int]] = {}
    for scope, figures in defaults.items():
        out[scope] = {}
        for f in LIMIT_FIELDS:
            value = own[scope].get(f)
            out[scope][f] = max(0, int(figures[f] if value is None else value))
    return out


def _key(scope: str, owner: Any, what: str) -> str:
    return f"racon:quota:{scope}:{owner}:{what}"


def inflight_keys(principal: KeyPrincipal) -> list[str]:
    return [
        _key("key", principal.key_id, "inflight"),
        _key("account", principal.account_id, "inflight"),
    ]


def quota_take(
    *, principal: KeyPrincipal, job_id: JobId, tokens: int, now: float | None = None
) -> Callable[[], None] | None:
    """Take one request and ``tokens`` tokens from the key's and the account's limits, and a
    place in flight; QuotaExceeded naming the first limit without room. Returns the release to
    call once when the job ends (None when no limit applies: the operator's key)."""
    if principal.key_id is None or principal.is_operator_key:
        return None
    limits = effective_limits(principal)
    owners = {"key": str(principal.key_id), "account": str(principal.account_id)}
    buckets: list[_Limit] = []
    sets: list[_Limit] = []
    for scope in ("key", "account"):
        figures = limits[scope]
        if figures["requests_per_minute"]:
            buckets.append(
                _Limit(
                    scope, owners[scope], "requests_per_minute", figures["requests_per_minute"], 1
                )
            )
        if figures["tokens_per_minute"]:
            buckets.append(
                _Limit(
                    scope,
                    owners[scope],
                    "tokens_per_minute",
                    figures["tokens_per_minute"],
                    max(0, int(tokens)),
                )
            )
        if figures["max_concurrent"]:
            sets.append(_Limit(scope, owners[scope], "max_concurrent", figures["max_concurrent"]))
    if not buckets and not sets:
        return None
    t = time.time() if now is None else float(now)
    lease = t + float(settings.RATE_INFLIGHT_LEASE_SECONDS)
    keys = [
        _key(b.scope, b.owner, "requests" if b.field == "requests_per_minute" else "tokens")
        for b in buckets
    ] + [_key(s.scope, s.owner, "inflight") for s in sets]
    args: list[Any] = [repr(t), str(job_id), repr(lease), len(buckets), len(sets)]
    for b in buckets:
        args += [b.figure, b.cost]
    args += [s.figure for s in sets]
    client = get_redis()
    script = _scripts.get(id(client))
    if script is None:
        script = _scripts[id(client)] = client.register_script(_TAKE_LUA)
    index, wait = script(keys=keys, args=args)
    index = int(index)
    if index:
        hit = (buckets + sets)[index - 1]
        raise QuotaExceeded(
            scope=hit.scope, limit=hit.field, figure=hit.figure, retry_after=float(wait)
        )
    set_keys = [_key(s.scope, s.owner, "inflight") for s in sets]
    if not set_keys:
        return None

    def release() -> None:
        quota_release(keys=set_keys, job_id=job_id)

    return release


def quota_release(*, keys: list[str], job_id: JobId) -> None:
    """The job's place in flight is free again (idempotent)."""
    with get_redis().pipeline(transaction=True) as pipe:
        for k in keys:
            pipe.zrem(k, str(job_id))
        pipe.execute()


def quota_state(principal: KeyPrincipal, *, now: float | None = None) -> dict[str, Any]:
    """The figures that apply and the requests in flight, per scope (for the keys API and page)."""
    t = time.time() if now is None else float(now)
    limits = effective_limits(principal)
    r = get_redis()
    out: dict[str, Any] = {}
    for scope, owner in (("key", principal.key_id), ("account", principal.account_id)):
        out[scope] = {
            **limits[scope],
            "in_flight": int(r.zcount(_key(scope, owner, "inflight"), f"({t!r}", "+inf")),
        }
    return out
