"""Domain metrics for Prometheus.

Two halves, both correct when several daphne and Celery processes run:
- recording: ``job_finished_observe`` adds a finished job's counts and timings to Redis hashes
  (racon:metrics:*) in whichever process finished it;
- scraping: ``RaconCollector`` reads everything else from the database and Redis at scrape time,
  with a fixed number of aggregate queries and one Redis round trip, whatever the cluster size.
No process-local state is exposed, so it does not matter which process answers a scrape.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from django.db.models import BigIntegerField, Case, Count, F, Q, Sum, When
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from agent.protocol import HEARTBEATS_ZSET, heartbeat_key
from apps.credits.models import EntryKind, Posting
from apps.credits.selectors import FEES, MINT
from apps.jobs import admission, kvcache
from apps.jobs.models import Deployment, Job
from apps.jobs.states import DEPLOYMENT_ACTIVE, JOB_OPEN, JOB_TERMINAL, DeploymentState, JobState
from apps.models_repo.models import Model
from apps.nodes.models import Node
from apps.nodes.services import BUSY_FLIPS_KEY
from apps.nodes.states import HEALTH_WATCHED, POOL, NodeState
from racon import __version__
from racon.ids import DeploymentId, JobId, ModelId
from racon.redis import get_redis

log = logging.getLogger("racon.metrics")

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the classic text format every Prometheus version reads

# Histogram buckets (seconds for TTFT and queue wait, tokens/s for throughput).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
HEARTBEAT_LAG_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)

# Redis keys written by the recording half (and by apps.jobs.services for placements).
JOBS_FINISHED_KEY = "racon:metrics:jobs_finished"  # "<model>|<state>" → count
TOKENS_KEY = "racon:metrics:tokens"  # "<model>" → completion tokens
PLACEMENTS_KEY = "racon:metrics:placements"
PLACEMENT_SECONDS_KEY = "racon:metrics:placement_seconds"
_HIST_BUCKETS = {"ttft": TTFT_BUCKETS, "tps": TPS_BUCKETS, "queue_wait": QUEUE_WAIT_BUCKETS}


def _hist_key(name: str) -> str:
    return f"racon:metrics:hist:{name}"


# --- recording -----------------------------------------------------------------------------------


def job_finished_observe(
    *, job_id: JobId, state: str, fields: dict[str, Any], row: tuple[Any, ...] | None = None
) -> None:
    """Count a finished job and observe its TTFT, tokens/s and queue wait (never fails the caller).
    ``row``: the job's model name, queued_at, dispatched_at and finished_at when the caller has
    them (the finish read them), else they are read here."""
    try:
        if row is None:
            row = (
                Job.objects.filter(pk=job_id)
                .values_list("model__name", "queued_at", "dispatched_at", "finished_at")
                .first()
            )
        model = (row[0] if row else None) or "unknown"
        r = get_redis()
        with r.pipeline(transaction=False) as pipe:
            pipe.hincrby(JOBS_FINISHED_KEY, f"{model}|{state}", 1)
            tokens = int(fields.get("completion_tokens") or 0)
            if tokens:
                pipe.hincrby(TOKENS_KEY, model, tokens)
            ttft = fields.get("ttft_ms")
            if ttft is not None:
                _observe(pipe, "ttft", model, float(ttft) / 1000.0)
            tps = fields.get("tokens_per_s")
            if tps is not None:
                _observe(pipe, "tps", model, float(tps))
            wait = _queue_wait(row)
            if wait is not None:
                _observe(pipe, "queue_wait", model, wait)
            pipe.execute()
    except Exception:  # metrics must never break a job's finish
        log.warning("could not record job metrics", exc_info=True)


def _queue_wait(row: tuple[Any, ...] | None) -> float | None:
    """Seconds from QUEUED to DISPATCHED, or to the end for a job that never left the queue."""
    if not row or row[1] is None:
        return None
    queued_at: datetime = row[1]
    left_queue: datetime | None = row[2] or row[3]
    if left_queue is None:
        return None
    return max(0.0, (left_queue - queued_at).total_seconds())


def _observe(pipe: Any, name: str, label: str, value: float) -> None:
    if not math.isfinite(value):
        return
    key = _hist_key(name)
    for b in _HIST_BUCKETS[name]:
        if value <= b:
            pipe.hincrby(key, f"{label}|{b}", 1)
    pipe.hincrby(key, f"{label}|+Inf", 1)
    pipe.hincrbyfloat(key, f"{label}|sum", value)


# --- scraping ------------------------------------------------------------------------------------

# Every family the collector emits: name → (type, labels). The Grafana test checks the dashboard
# against this table, and a unit test checks that a scrape emits exactly these families.
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "racon_build_info": ("gauge", ("version",)),
    "racon_nodes": ("gauge", ("state",)),
    "racon_pool_nodes": ("gauge", ()),
    "racon_pool_cpu_cores": ("gauge", ()),
    "racon_pool_ram_bytes": ("gauge", ("kind",)),
    "racon_pool_vram_bytes": ("gauge", ("kind",)),
    "racon_node_heartbeat_lag_seconds": ("gauge", ()),
    "racon_heartbeat_lag_seconds": ("gaugehistogram", ()),
    "racon_deployments": ("gauge", ("state",)),
    "racon_jobs": ("gauge", ("state", "model")),
    "racon_jobs_finished": ("counter", ("state", "model")),
    "racon_queue_depth": ("gauge", ()),
    "racon_replicas": ("gauge", ("model",)),
    "racon_deployment_slots_in_use": ("gauge", ("deployment", "model")),
    "racon_deployment_slots_free": ("gauge", ("deployment", "model")),
    "racon_model_queue_depth": ("gauge", ("model",)),
    "racon_model_queue_wait_seconds": ("gauge", ("model",)),
    "racon_replica_tokens_per_second": ("gauge", ("deployment", "model")),
    "racon_queue_wait_seconds": ("histogram", ("model",)),
    "racon_ttft_seconds": ("histogram", ("model",)),
    "racon_tokens_per_second": ("histogram", ("model",)),
    "racon_tokens_generated": ("counter", ("model",)),
    "racon_credits_minted": ("counter", ("kind",)),
    "racon_credits_burned": ("counter", ()),
    "racon_credits_spent": ("counter", ()),
    "racon_placement_decisions": ("counter", ()),
    "racon_node_busy_flips": ("counter", ()),
    "racon_placement_latency_seconds": ("summary", ()),
    "racon_kv_prefix_hits": ("counter", ()),
    "racon_kv_prefix_misses": ("counter", ()),
    "racon_kv_tokens_saved": ("counter", ()),
    "racon_kv_ownership_changes": ("counter", ("kind",)),
    "racon_kv_bytes_moved": ("counter", ()),
    "racon_kv_transfer_seconds": ("counter", ()),
    "racon_kv_conversations_held": ("gauge", ("deployment",)),
    "racon_kv_tokens_held": ("gauge", ("deployment",)),
    "racon_scrape_duration_seconds": ("gauge", ()),
}

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("_sum", "_count"),
    "gauge": ("",),
}


def sample_names() -> dict[str, tuple[str, ...]]:
    """Every series name a scrape can carry (suffixes included) → its label names."""
    out: dict[str, tuple[str, ...]] = {}
    for name, (kind, labels) in FAMILIES.items():
        for suffix in _SUFFIXES[kind]:
            out[name + suffix] = labels + (("le",) if suffix == "_bucket" else ())
    return out


class RaconCollector:
    """Reads the cluster's figures at scrape time: 8 aggregate queries and one Redis round trip."""

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no samples at registration time: collect() touches the database

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        yield from _collect(now=time.time())
        g = GaugeMetricFamily(
            "racon_scrape_duration_seconds",
            "Seconds this scrape spent reading the database and Redis.",
        )
        g.add_metric([], time.perf_counter() - t0)
        yield g


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(RaconCollector())


def metrics_render() -> bytes:
    """The whole exposition, in the Prometheus text format."""
    return generate_latest(REGISTRY)


def _collect(*, now: float) -> Iterator[Metric]:
    db = _read_database(now=now)
    rd = _read_redis(
        node_ids=[n["id"] for n in db["pool_nodes"]],
        watched_ids=db["watched_ids"],
        deployment_ids=db["active_deployments"],
        model_ids=sorted({row["model_id"] for row in db["replicas"]}),
        now=now,
    )

    info = GaugeMetricFamily(
        "racon_build_info", "The controller's version (always 1).", labels=["version"]
    )
    info.add_metric([__version__], 1)
    yield info

    nodes = GaugeMetricFamily(
        "racon_nodes", "Nodes by state (revoked nodes included, as OFFLINE).", labels=["state"]
    )
    for state in NodeState.values:
        nodes.add_metric([state], db["nodes_by_state"].get(state, 0))
    yield nodes

    yield from _pool(db["pool_nodes"], rd["live_free"])
    yield from _heartbeats(rd["lag"])

    deps = GaugeMetricFamily("racon_deployments", "Deployments by state.", labels=["state"])
    for state in DeploymentState.values:
        deps.add_metric([state], db["deployments_by_state"].get(state, 0))
    yield deps

    finished = _parse_pairs(rd["jobs_finished"])
    models = sorted(
        set(db["models"]) | {m for m, _ in db["jobs_active"]} | {m for m, _ in finished}
    )
    jobs = GaugeMetricFamily(
        "racon_jobs",
        "Jobs by state and model: QUEUED, DISPATCHED and RUNNING are counted live in the database; "
        "terminal states count the jobs that finished since the metrics began (Redis).",
        labels=["state", "model"],
    )
    done = CounterMetricFamily(
        "racon_jobs_finished", "Jobs that reached a terminal state.", labels=["state", "model"]
    )
    terminal = JOB_TERMINAL
    for model in models:
        for state in JobState.values:
            if state in terminal:
                value = finished.get((model, state), 0)
                done.add_metric([state, model], value)
            else:
                value = db["jobs_active"].get((model, state), 0)
            jobs.add_metric([state, model], value)
    yield jobs
    yield done

    depth = GaugeMetricFamily(
        "racon_queue_depth", "Requests waiting for a slot, summed over active deployments."
    )
    depth.add_metric([], sum(int(n or 0) for n in rd["waiting"]))
    yield depth
    yield from _replicas(db["replicas"], db["replica_tokens"], rd)

    yield _histogram(
        "racon_queue_wait_seconds",
        "Seconds a job waited in the queue before dispatch.",
        rd["hist"]["queue_wait"],
        QUEUE_WAIT_BUCKETS,
        models,
    )
    yield _histogram(
        "racon_ttft_seconds",
        "Time to first token of finished jobs.",
        rd["hist"]["ttft"],
        TTFT_BUCKETS,
        models,
    )
    yield _histogram(
        "racon_tokens_per_second",
        "Generation speed of finished jobs.",
        rd["hist"]["tps"],
        TPS_BUCKETS,
        models,
    )

    tokens = CounterMetricFamily(
        "racon_tokens_generated", "Completion tokens generated, by model.", labels=["model"]
    )
    token_counts = {k: int(v) for k, v in (rd["tokens"] or {}).items()}
    for model in sorted(set(models) | set(token_counts)):
        tokens.add_metric([model], token_counts.get(model, 0))
    yield tokens

    minted = CounterMetricFamily(
        "racon_credits_minted",
        "Micro-credits created by the mint (grants, adjustments, standby pay), by entry kind.",
        labels=["kind"],
    )
    for kind in ("GRANT", "ADJUST", "STANDBY"):
        minted.add_metric([kind], db["minted"].get(kind, 0))
    yield minted
    burned = CounterMetricFamily(
        "racon_credits_burned", "Micro-credits taken back into the mint (negative adjustments)."
    )
    burned.add_metric([], db["burned"])
    yield burned
    spent = CounterMetricFamily(
        "racon_credits_spent", "Micro-credits consumers paid for inference (settled charges)."
    )
    spent.add_metric([], db["spent"])
    yield spent

    decisions = CounterMetricFamily(
        "racon_placement_decisions", "Scheduler runs (placements and previews)."
    )
    decisions.add_metric([], int(rd["placements"] or 0))
    yield decisions
    flips = CounterMetricFamily(
        "racon_node_busy_flips",
        "Nodes' BUSY/READY moves: counted here, not written as events (a node may flip each beat).",
    )
    flips.add_metric([], int(rd["busy_flips"] or 0))
    yield flips
    latency = SummaryMetricFamily(
        "racon_placement_latency_seconds", "Time the scheduler spent planning."
    )
    latency.add_metric(
        [], count_value=int(rd["placements"] or 0), sum_value=float(rd["placement_seconds"] or 0.0)
    )
    yield latency
    yield from _kvcache(db["active_deployments"])


def _kvcache(deployment_ids: list[str]) -> Iterator[Metric]:
    """The KV cache coordinator's counters and what each replica's slots hold (apps/jobs/kvcache.py)."""
    st = kvcache.stats()
    for name, key, text in (
        ("racon_kv_prefix_hits", "hits", "Requests routed to the slot holding their prefix."),
        ("racon_kv_prefix_misses", "misses", "Requests with no cached prefix on their replica."),
        (
            "racon_kv_tokens_saved",
            "tokens_saved",
            "Prompt tokens taken from a slot's cache on hits.",
        ),
        ("racon_kv_bytes_moved", "bytes_moved", "KV state bytes moved between nodes."),
        ("racon_kv_transfer_seconds", "transfer_seconds", "Seconds spent moving KV state."),
    ):
        c = CounterMetricFamily(name, text)
        c.add_metric([], st[key])
        yield c
    changes = CounterMetricFamily(
        "racon_kv_ownership_changes",
        "Ownership changes: moved (to another replica), evicted (LRU bound), displaced (slot "
        "reused by another conversation), dropped (replica stopped serving; state not moved).",
        labels=["kind"],
    )
    for kind in ("moved", "evicted", "displaced", "dropped"):
        changes.add_metric([kind], st[kind])
    yield changes
    held = kvcache.deployments_held(deployment_ids)
    convs = GaugeMetricFamily(
        "racon_kv_conversations_held",
        "Conversation prefixes held in a replica's slots.",
        labels=["deployment"],
    )
    toks = GaugeMetricFamily(
        "racon_kv_tokens_held", "Tokens those prefixes hold.", labels=["deployment"]
    )
    for dep_id, (n, t) in sorted(held.items()):
        convs.add_metric([dep_id], n)
        toks.add_metric([dep_id], t)
    yield convs
    yield toks


# Tokens/s per replica: completion tokens of the jobs it finished within this window, per second.
REPLICA_TOKENS_WINDOW_SECONDS = 60.0


def _replicas(
    rows: list[dict[str, Any]], tokens: dict[str, int], rd: dict[str, Any]
) -> Iterator[Metric]:
    """Replicas per model, slots per deployment, each model's queue, and tokens/s per replica."""
    replicas = GaugeMetricFamily(
        "racon_replicas", "Active deployments (replicas) of each model.", labels=["model"]
    )
    in_use = GaugeMetricFamily(
        "racon_deployment_slots_in_use",
        "Slots of an active deployment held by running jobs (live leases).",
        labels=["deployment", "model"],
    )
    free = GaugeMetricFamily(
        "racon_deployment_slots_free",
        "Slots of an active deployment free for a new request (n_parallel minus in use).",
        labels=["deployment", "model"],
    )
    tps = GaugeMetricFamily(
        "racon_replica_tokens_per_second",
        f"Completion tokens per second a replica delivered over the last "
        f"{REPLICA_TOKENS_WINDOW_SECONDS:.0f} s (finished jobs).",
        labels=["deployment", "model"],
    )
    per_model: dict[str, int] = {}
    names: dict[str, str] = {}
    for row in rows:
        dep, model = row["id"], row["model"]
        names[row["model_id"]] = model
        per_model[model] = per_model.get(model, 0) + 1
        used = rd["slots_in_use"].get(dep, 0)
        in_use.add_metric([dep, model], used)
        free.add_metric([dep, model], max(0, int(row["n_parallel"] or 1) - used))
        tps.add_metric([dep, model], tokens.get(dep, 0) / REPLICA_TOKENS_WINDOW_SECONDS)
    for model in sorted(per_model):
        replicas.add_metric([model], per_model[model])
    yield replicas
    yield in_use
    yield free
    depth = GaugeMetricFamily(
        "racon_model_queue_depth",
        "Requests waiting for a slot, over every replica of the model (live waiters).",
        labels=["model"],
    )
    wait = GaugeMetricFamily(
        "racon_model_queue_wait_seconds",
        "The model's recent queue wait (admission's EWMA), which the replica autoscaler follows.",
        labels=["model"],
    )
    waiters: dict[str, int] = {}
    for row in rows:
        waiters[row["model"]] = waiters.get(row["model"], 0) + rd["waiters"].get(row["id"], 0)
    for model_id, model in sorted(names.items(), key=lambda kv: kv[1]):
        depth.add_metric([model], waiters.get(model, 0))
        wait.add_metric([model], rd["model_wait"].get(model_id, 0.0))
    yield depth
    yield wait
    yield tps


def _read_database(*, now: float) -> dict[str, Any]:
    """The scrape's database reads: a fixed set of aggregate queries, none per node or per job."""

    out: dict[str, Any] = {}
    out["nodes_by_state"] = dict(
        Node.objects.order_by().values_list("state").annotate(n=Count("id"))
    )
    # The pool: nodes connected to the controller (serving, draining or degraded), not revoked.
    pool_states = POOL
    watched_states = sorted(HEALTH_WATCHED)
    # Plain dicts, not the values() row type: the ids are rewritten to strings below.
    rows: list[dict[str, Any]] = [
        dict(row)
        for row in Node.objects.filter(revoked_at__isnull=True, state__in=watched_states)
        .order_by()
        .values(
            "id",
            "state",
            "cpu_physical_cores",
            "cpu_logical_cores",
            "ram_total",
            "ram_available",
            "vram_total",
            "vram_free",
        )
    ]
    for row in rows:
        row["id"] = str(row["id"])
    out["pool_nodes"] = [r for r in rows if r["state"] in pool_states]
    out["watched_ids"] = [r["id"] for r in rows]
    out["deployments_by_state"] = dict(
        Deployment.objects.order_by().values_list("state").annotate(n=Count("id"))
    )
    out["replicas"] = [
        {"id": str(d), "model_id": str(m), "model": name, "n_parallel": n}
        for d, m, name, n in Deployment.objects.filter(state__in=list(DEPLOYMENT_ACTIVE))
        .order_by("created_at")
        .values_list("id", "model_id", "model__name", "n_parallel")
    ]
    out["active_deployments"] = [row["id"] for row in out["replicas"]]
    since = datetime.fromtimestamp(now - REPLICA_TOKENS_WINDOW_SECONDS, tz=UTC)
    out["replica_tokens"] = {
        str(d): int(t or 0)
        for d, t in Job.objects.filter(
            state=JobState.COMPLETED, finished_at__gte=since, deployment_id__isnull=False
        )
        .order_by()
        .values_list("deployment_id")
        .annotate(t=Sum("completion_tokens"))
    }
    active = JOB_OPEN
    out["jobs_active"] = {
        (m, s): n
        for m, s, n in Job.objects.filter(state__in=active)
        .order_by()
        .values_list("model__name", "state")
        .annotate(n=Count("id"))
    }
    out["models"] = list(Model.objects.values_list("name", flat=True))
    # The mint's postings: negative ones create credits, positive ones (negative adjustments) burn them.
    mint_rows = (
        Posting.objects.filter(account__name=MINT)
        .order_by()
        .values("entry__kind")
        .annotate(
            minted=Sum(
                Case(
                    When(amount__lt=0, then=-F("amount")), default=0, output_field=BigIntegerField()
                )
            ),
            burned=Sum(
                Case(
                    When(amount__gt=0, then=F("amount")), default=0, output_field=BigIntegerField()
                )
            ),
        )
    )
    out["minted"] = {r["entry__kind"]: int(r["minted"] or 0) for r in mint_rows}
    out["burned"] = sum(0 if r["burned"] is None else int(r["burned"]) for r in mint_rows)
    # What consumers paid = the settled value: node payouts (they carry a beneficiary) plus fees.
    # The consumer's refund of an unused hold is the one positive leg with neither.
    out["spent"] = int(
        Posting.objects.filter(entry__kind=EntryKind.SETTLE, amount__gt=0)
        .filter(Q(beneficiary__isnull=False) | Q(account__name=FEES))
        .aggregate(s=Sum("amount"))["s"]
        or 0
    )
    return out


# Free memory of many nodes in one command: per-node HMGETs would cost a command each to pack and
# parse (~30 µs apiece in redis-py), which dominated a 1,000-node scrape. Sums stay exact below
# 2^53 bytes (doubles); the indexes of nodes without telemetry come back for the database fallback.
_LIVE_FREE_LUA = """
local ram, vram, missing = 0, 0, {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'mem_available', 'gpu_free')
  local mem = tonumber(v[1])
  if mem then
    ram = ram + mem
    if v[2] then
      for g in string.gmatch(v[2], '[^,]+') do vram = vram + (tonumber(g) or 0) end
    end
  else
    missing[#missing + 1] = i - 1
  end
end
return {string.format('%.0f', ram), string.format('%.0f', vram), missing}
"""


# Heartbeat lag of the watched nodes, computed next to the zset: returning the whole zset (ZRANGE
# WITHSCORES) costs a float parse per member in redis-py, ~10 ms at 1,000 nodes. The controller's
# clock is passed in, the same clock that wrote the scores.
_LAG_LUA = """
local now, nb = tonumber(ARGV[1]), tonumber(ARGV[2])
local counts = {}
for b = 1, nb do counts[b] = 0 end
local n, total, worst = 0, 0, 0
for i = 3 + nb, #ARGV do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s then
    local lag = now - tonumber(s)
    if lag < 0 then lag = 0 end
    n, total = n + 1, total + lag
    if lag > worst then worst = lag end
    for b = 1, nb do
      if lag <= tonumber(ARGV[2 + b]) then counts[b] = counts[b] + 1 end
    end
  end
end
local out = {tostring(n), string.format('%.6f', total), string.format('%.6f', worst)}
for b = 1, nb do out[#out + 1] = tostring(counts[b]) end
return out
"""


def _read_redis(
    *,
    node_ids: list[str],
    watched_ids: list[str],
    deployment_ids: list[str],
    model_ids: list[str],
    now: float,
) -> dict[str, Any]:
    """Everything the scrape needs from Redis, in one pipelined round trip."""
    r = get_redis()
    with r.pipeline(transaction=False) as pipe:
        pipe.eval(
            _LAG_LUA,
            1,
            HEARTBEATS_ZSET,
            repr(now),
            len(HEARTBEAT_LAG_BUCKETS),
            *HEARTBEAT_LAG_BUCKETS,
            *watched_ids,
        )
        pipe.hgetall(JOBS_FINISHED_KEY)
        pipe.hgetall(TOKENS_KEY)
        pipe.get(PLACEMENTS_KEY)
        pipe.get(PLACEMENT_SECONDS_KEY)
        for name in _HIST_BUCKETS:
            pipe.hgetall(_hist_key(name))
        pipe.eval(_LIVE_FREE_LUA, len(node_ids), *[heartbeat_key(n) for n in node_ids])
        # Only active deployments can have waiters: no SCAN over the whole keyspace.
        for dep_id in deployment_ids:
            pipe.zcard(f"racon:dep:{dep_id}:waiting")
        # Admission's keys, read as admission.slots_in_use / queue_depth / model_queue_wait read
        # them, folded into this round trip: live leases only, the wait decayed to now.
        live = f"({now!r}"
        for dep_id in deployment_ids:
            pipe.zcount(admission.slots_key(DeploymentId(dep_id)), live, "+inf")
            pipe.zcount(admission.waitlease_key(DeploymentId(dep_id)), live, "+inf")
        for model_id in model_ids:
            pipe.hmget(admission.model_wait_key(ModelId(model_id)), ["ewma", "updated"])
        pipe.get(BUSY_FLIPS_KEY)
        got = pipe.execute()
    busy_flips = got.pop()
    lag, jobs_finished, tokens, placements, placement_seconds = got[:5]
    n = len(_HIST_BUCKETS)
    hists = dict(zip(_HIST_BUCKETS, got[5 : 5 + n], strict=True))
    ram, vram, missing = got[5 + n]
    k = 6 + n + len(deployment_ids)
    per_dep = got[k : k + 2 * len(deployment_ids)]
    waits = got[k + 2 * len(deployment_ids) :]
    model_wait: dict[str, float] = {}
    for model_id, (ewma, updated) in zip(model_ids, waits, strict=True):
        if ewma is not None and updated is not None:
            age = max(0.0, now - float(updated))
            model_wait[model_id] = float(ewma) * 0.5 ** (age / admission.WAIT_HALF_LIFE_SECONDS)
    return {
        "lag": (int(lag[0]), float(lag[1]), float(lag[2]), [int(c) for c in lag[3:]]),
        "jobs_finished": jobs_finished,
        "tokens": tokens,
        "placements": placements,
        "placement_seconds": placement_seconds,
        "busy_flips": busy_flips,
        "hist": hists,
        "live_free": (int(ram), int(vram), {node_ids[int(i)] for i in missing}),
        "waiting": got[6 + n : k],
        "slots_in_use": {d: int(c) for d, c in zip(deployment_ids, per_dep[0::2], strict=True)},
        "waiters": {d: int(c) for d, c in zip(deployment_ids, per_dep[1::2], strict=True)},
        "model_wait": model_wait,
    }


def _pool(rows: list[dict[str, Any]], live_free: tuple[int, int, set[str]]) -> Iterator[Metric]:
    live_ram, live_vram, no_telemetry = live_free
    cores = ram_total = vram_total = 0
    ram_free, vram_free = live_ram, live_vram
    for row in rows:
        cores += row["cpu_physical_cores"] or row["cpu_logical_cores"] or 0
        ram_total += row["ram_total"]
        vram_total += row["vram_total"]
        # Free memory is the last heartbeat's telemetry; a node that has not sent one since Redis
        # started counts with the database's figure (as of its last state change).
        if row["id"] in no_telemetry:
            ram_free += row["ram_available"]
            vram_free += row["vram_free"]
    n = GaugeMetricFamily(
        "racon_pool_nodes", "Nodes in the pool (READY, BUSY, DRAINING or DEGRADED, not revoked)."
    )
    n.add_metric([], len(rows))
    yield n
    c = GaugeMetricFamily(
        "racon_pool_cpu_cores", "Physical CPU cores in the pool (logical where unknown)."
    )
    c.add_metric([], cores)
    yield c
    ram = GaugeMetricFamily(
        "racon_pool_ram_bytes", "RAM in the pool: total and free.", labels=["kind"]
    )
    ram.add_metric(["total"], ram_total)
    ram.add_metric(["free"], ram_free)
    yield ram
    vram = GaugeMetricFamily(
        "racon_pool_vram_bytes", "GPU memory in the pool: total and free.", labels=["kind"]
    )
    vram.add_metric(["total"], vram_total)
    vram.add_metric(["free"], vram_free)
    yield vram


def _heartbeats(lag: tuple[int, float, float, list[int]]) -> Iterator[Metric]:
    """Lag of the nodes the health sweep watches: long-gone nodes would only pin the maximum."""
    count, total, worst, buckets = lag
    g = GaugeMetricFamily(
        "racon_node_heartbeat_lag_seconds",
        "Largest time since the last heartbeat among live nodes (0 when there are none).",
    )
    g.add_metric([], worst)
    yield g
    hist = GaugeHistogramMetricFamily(
        "racon_heartbeat_lag_seconds",
        "Live nodes by time since their last heartbeat (a snapshot, not a counter).",
    )
    series = [(_le(b), float(c)) for b, c in zip(HEARTBEAT_LAG_BUCKETS, buckets, strict=True)]
    series.append(("+Inf", float(count)))
    hist.add_metric([], buckets=series, gsum_value=total)
    yield hist


def _histogram(
    name: str, doc: str, raw: dict[str, str], buckets: tuple[float, ...], models: list[str]
) -> Metric:
    """A cumulative histogram per model from a racon:metrics:hist:* hash (fields '<model>|<le>')."""
    h = HistogramMetricFamily(name, doc, labels=["model"])
    labels = sorted(set(models) | {k.rsplit("|", 1)[0] for k in raw})
    for model in labels:
        series = [(_le(b), float(raw.get(f"{model}|{b}", 0))) for b in buckets]
        series.append(("+Inf", float(raw.get(f"{model}|+Inf", 0))))
        h.add_metric([model], buckets=series, sum_value=float(raw.get(f"{model}|sum", 0.0)))
    return h


def _le(bound: float) -> str:
    return repr(float(bound))


def _parse_pairs(raw: dict[str, str] | None) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for key, value in (raw or {}).items():
        model, _, state = key.rpartition("|")
        out[(model, state)] = int(value)
    return out
