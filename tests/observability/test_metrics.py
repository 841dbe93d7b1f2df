"""The /metrics view's access rules and the collector's figures, read from the database and Redis."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from agent.protocol import HEARTBEATS_ZSET, heartbeat_key
from apps.api.auth import api_key_create
from apps.api.metrics import FAMILIES, job_finished_observe, metrics_render
from apps.credits.ledger import account_for_user, credit_adjust
from apps.credits.settlement import credit_reserve, credit_settle_job
from apps.jobs.jobs import job_complete, job_create, job_fail
from apps.jobs.models import Deployment, Job
from apps.models_repo.models import ModelFile
from apps.nodes.states import NodeState
from racon import ids
from racon.ids import JobId
from racon.redis import get_redis
from tests.factories import AccountFactory, NodeFactory, UserFactory
from tests.support.observability import make_deployment, make_job

pytestmark = pytest.mark.django_db

TOKEN = "scrape-token-" + "t" * 30
GIB = 1024**3


def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics_render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def v(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in got, f"{name}{labels} missing"
    return got[key]


# --- access --------------------------------------------------------------------------------------


@pytest.fixture
def token(settings: Any) -> str:
    settings.METRICS_TOKEN = TOKEN
    return TOKEN


def test_a_scrape_without_credentials_gets_401(client: Any, token: str) -> None:
    resp = client.get("/metrics")
    assert resp.status_code == 401
    assert resp["WWW-Authenticate"].startswith("Bearer")


def test_a_wrong_token_gets_401(client: Any, token: str) -> None:
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong-token").status_code == 401


def test_an_empty_metrics_token_never_matches_an_empty_bearer(client: Any, settings: Any) -> None:
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401


def test_the_metrics_token_gets_the_prometheus_text_format(client: Any, token: str) -> None:
    resp = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 200
    assert resp["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'racon_nodes{state="READY"} 0.0' in resp.content


def test_an_admin_key_and_a_staff_session_may_scrape(
    client: Any, token: str, settings: Any
) -> None:
    assert (
        client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.AI_API_KEY}").status_code
        == 200
    )
    staff = UserFactory(is_staff=True)
    client.force_login(staff)
    assert client.get("/metrics").status_code == 200


def test_an_inference_key_or_a_plain_user_is_forbidden(client: Any, token: str) -> None:
    user = UserFactory()
    _, key = api_key_create(
        name="k",
        account_id=ids.account_id(account_for_user(user=user).id),
        scopes=["inference"],
        user_id=user.pk,
    )
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 403
    client.force_login(user)
    assert client.get("/metrics").status_code == 403


def test_metrics_answers_only_get(client: Any, token: str) -> None:
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 405


# --- figures -------------------------------------------------------------------------------------


def test_every_node_state_is_reported_even_when_zero() -> None:
    NodeFactory(state=NodeState.READY)
    NodeFactory(state=NodeState.READY)
    NodeFactory(state=NodeState.OFFLINE)
    got = scrape()
    assert {s: v(got, "racon_nodes", state=s) for s in NodeState.values} == {
        "UNINITIALIZED": 0,
        "REGISTERING": 0,
        "READY": 2,
        "BUSY": 0,
        "DRAINING": 0,
        "DRAINED": 0,
        "DEGRADED": 0,
        "OFFLINE": 1,
        "ERROR": 0,
    }


def test_the_pool_sums_connected_nodes_with_live_free_memory() -> None:
    a = NodeFactory(
        state=NodeState.READY,
        cpu_physical_cores=4,
        ram_total=16 * GIB,
        ram_available=8 * GIB,
        vram_total=24 * GIB,
        vram_free=20 * GIB,
    )
    NodeFactory(
        state=NodeState.DRAINING, cpu_physical_cores=2, ram_total=8 * GIB, ram_available=4 * GIB
    )
    NodeFactory(
        state=NodeState.OFFLINE, cpu_physical_cores=64, ram_total=512 * GIB, ram_available=512 * GIB
    )
    # The last heartbeat of `a` says less is free now than at its last state change.
    get_redis().hset(
        heartbeat_key(str(a.id)),
        mapping={"mem_available": 6 * GIB, "gpu_free": f"{10 * GIB},{2 * GIB}"},
    )
    got = scrape()
    assert v(got, "racon_pool_nodes") == 2
    assert v(got, "racon_pool_cpu_cores") == 6
    assert v(got, "racon_pool_ram_bytes", kind="total") == 24 * GIB
    assert v(got, "racon_pool_ram_bytes", kind="free") == 6 * GIB + 4 * GIB
    assert v(got, "racon_pool_vram_bytes", kind="total") == 24 * GIB
    assert v(got, "racon_pool_vram_bytes", kind="free") == 12 * GIB


def test_heartbeat_lag_covers_live_nodes_only() -> None:
    now = time.time()
    fresh, late = NodeFactory(state=NodeState.READY), NodeFactory(state=NodeState.DEGRADED)
    gone = NodeFactory(state=NodeState.OFFLINE)
    get_redis().zadd(
        HEARTBEATS_ZSET, {str(fresh.id): now - 1, str(late.id): now - 20, str(gone.id): now - 86400}
    )
    got = scrape()
    assert 20 <= v(got, "racon_node_heartbeat_lag_seconds") < 25
    assert v(got, "racon_heartbeat_lag_seconds_gcount") == 2
    assert v(got, "racon_heartbeat_lag_seconds_bucket", le="2.0") == 1
    assert v(got, "racon_heartbeat_lag_seconds_bucket", le="30.0") == 2


def test_deployments_jobs_and_queue_depth(model_file: ModelFile, now: Any) -> None:
    ready = make_deployment(model_file, state="READY")
    stopped = make_deployment(model_file, state="STOPPED")
    make_job(model_file, state="QUEUED", now=now, deployment=ready)
    make_job(model_file, state="RUNNING", now=now, deployment=ready)
    make_job(model_file, state="RUNNING", now=now, deployment=ready)
    r = get_redis()
    r.zadd(f"racon:dep:{ready.id}:waiting", {"j1": 1, "j2": 2})
    r.zadd(f"racon:dep:{stopped.id}:waiting", {"j3": 1})  # a stopped deployment serves nobody
    got = scrape()
    assert v(got, "racon_deployments", state="READY") == 1
    assert v(got, "racon_deployments", state="STOPPED") == 1
    assert v(got, "racon_deployments", state="PLANNING") == 0
    assert v(got, "racon_jobs", state="QUEUED", model="tiny-model") == 1
    assert v(got, "racon_jobs", state="RUNNING", model="tiny-model") == 2
    assert v(got, "racon_jobs", state="COMPLETED", model="tiny-model") == 0
    assert v(got, "racon_queue_depth") == 2


def test_a_finished_job_feeds_counters_and_histograms(model_file: ModelFile, now: Any) -> None:
    job = make_job(
        model_file,
        state="RUNNING",
        now=now - timedelta(seconds=3),
        queued_at=now - timedelta(seconds=3),
        dispatched_at=now - timedelta(seconds=1),
    )
    assert job_complete(
        job_id=ids.job_id(job.id),
        usage={"prompt_tokens": 5, "completion_tokens": 40, "ttft_ms": 120.0, "tokens_per_s": 33.0},
        finish_reason="stop",
        chunks=40,
        now=now,
    )
    failed = make_job(model_file, state="QUEUED", now=now)
    job_fail(job_id=ids.job_id(failed.id), now=now, error="no capacity", during_execution=False)
    got = scrape()
    m = "tiny-model"
    assert v(got, "racon_jobs", state="COMPLETED", model=m) == 1
    assert v(got, "racon_jobs", state="FAILED", model=m) == 1
    assert v(got, "racon_jobs_finished_total", state="COMPLETED", model=m) == 1
    assert v(got, "racon_tokens_generated_total", model=m) == 40
    assert v(got, "racon_ttft_seconds_count", model=m) == 1
    assert v(got, "racon_ttft_seconds_sum", model=m) == pytest.approx(0.12)
    assert v(got, "racon_ttft_seconds_bucket", model=m, le="0.1") == 0
    assert v(got, "racon_ttft_seconds_bucket", model=m, le="0.25") == 1
    assert v(got, "racon_tokens_per_second_bucket", model=m, le="50.0") == 1
    assert v(got, "racon_tokens_per_second_bucket", model=m, le="20.0") == 0
    # Queue wait: 2 s for the dispatched job; the failed one waited 0 s and never left the queue.
    assert v(got, "racon_queue_wait_seconds_count", model=m) == 2
    assert v(got, "racon_queue_wait_seconds_sum", model=m) == pytest.approx(2.0)


def test_metrics_recording_never_breaks_a_finish() -> None:
    job_finished_observe(
        job_id=JobId("not-a-uuid"), state="COMPLETED", fields={"ttft_ms": "bad"}
    )  # must not raise


def test_credits_minted_spent_and_burned_follow_the_ledger(
    model_file: ModelFile, now: Any, settings: Any
) -> None:
    settings.CREDITS_STARTING_GRANT = 5_000_000
    settings.CREDITS_MICRO_PER_TOKEN = 1_000
    account = account_for_user(user=UserFactory())
    credit_adjust(
        account_id=ids.account_id(account.id), amount=-1_000_000, reason="correction", now=now
    )

    def hold(j: Job) -> None:
        credit_reserve(
            account_id=ids.account_id(str(j.account_id)),
            job_id=ids.job_id(j.id),
            max_tokens=j.max_tokens,
            model_price_permille=j.model.price_weight_permille,
            now=now,
        )

    job = job_create(
        model=model_file.model,
        account_id=ids.account_id(account.id),
        api_key_id=None,
        kind="chat",
        params={},
        max_tokens=100,
        stream=False,
        request_id="r",
        now=now,
        hold=hold,
    )
    Job.objects.filter(pk=job.id).update(state="RUNNING", dispatched_at=now)
    job_complete(
        job_id=ids.job_id(job.id),
        usage={"prompt_tokens": 10, "completion_tokens": 20},
        finish_reason="stop",
        chunks=20,
        now=now,
    )
    entry = credit_settle_job(job_id=ids.job_id(job.id), now=now)
    got = scrape()
    assert v(got, "racon_credits_minted_total", kind="GRANT") == 5_000_000
    assert v(got, "racon_credits_minted_total", kind="STANDBY") == 0
    assert v(got, "racon_credits_burned_total") == 1_000_000
    assert entry.data["charged"] == 30 * 1_000
    assert v(got, "racon_credits_spent_total") == 30 * 1_000


def test_placement_counters_come_from_the_scheduler_runs() -> None:
    r = get_redis()
    r.set("racon:metrics:placements", 3)
    r.set("racon:metrics:placement_seconds", 0.75)
    got = scrape()
    assert v(got, "racon_placement_decisions_total") == 3
    assert v(got, "racon_placement_latency_seconds_count") == 3
    assert v(got, "racon_placement_latency_seconds_sum") == 0.75


def test_a_scrape_emits_exactly_the_declared_families(model_file: ModelFile) -> None:
    families = {f.name: f.type for f in text_string_to_metric_families(metrics_render().decode())}
    # The text parser names counters without _total and folds a gauge histogram's _gsum/_gcount
    # into separate gauges: undo both before comparing.
    declared = {name: kind for name, (kind, _) in FAMILIES.items()}
    got = {n: t for n, t in families.items() if not n.endswith(("_gsum", "_gcount"))}
    assert set(got) == set(declared)
    for name, kind in declared.items():
        assert got[name] == ("histogram" if kind == "gaugehistogram" else kind), name


def test_scrape_queries_do_not_grow_with_the_cluster(model_file: ModelFile, now: Any) -> None:
    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            metrics_render()
        return len(ctx.captured_queries)

    account = AccountFactory()
    NodeFactory(account=account)
    small = count()
    for _ in range(60):
        NodeFactory(account=account, state=NodeState.READY)
    dep = make_deployment(model_file)
    for _ in range(20):
        make_job(model_file, state="RUNNING", now=now, deployment=dep)
    assert count() == small
    assert small <= 10


def test_a_scrape_while_redis_is_down_answers_503(
    client: Any, token: str, monkeypatch: Any
) -> None:
    import redis

    from apps.api import metrics

    def down() -> Any:
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(metrics, "_read_redis", lambda **kw: down())
    resp = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "unavailable"


def test_replicas_slots_queue_and_tokens_per_second_per_replica(
    model_file: ModelFile, now: Any
) -> None:
    from apps.jobs import admission

    a, b = NodeFactory(), NodeFactory()
    one = make_deployment(model_file, state="READY", primary=a, nodes=[a])
    two = make_deployment(model_file, state="READY", primary=b, nodes=[b])
    make_deployment(model_file, state="STOPPED")  # not a replica any more
    Deployment.objects.filter(pk__in=[one.pk, two.pk]).update(n_parallel=4)
    t = time.time()
    assert admission.slot_try(
        deployment_id=ids.deployment_id(one.id), job_id=JobId("j1"), cap=4, now=t
    )
    assert admission.slot_try(
        deployment_id=ids.deployment_id(one.id), job_id=JobId("j2"), cap=4, now=t
    )
    admission.queue_join(
        deployment_id=ids.deployment_id(two.id),
        job_id=JobId("w1"),
        priority=1,
        model_id=ids.model_id(model_file.model_id),
        now=t,
    )
    admission.queue_wait_record(model_id=ids.model_id(model_file.model_id), seconds=3.0, now=t)
    done = make_job(model_file, state="RUNNING", now=now, deployment=one)
    job_complete(
        job_id=ids.job_id(done.id),
        usage={"completion_tokens": 120},
        finish_reason="stop",
        chunks=120,
        now=timezone.now(),
    )
    old = make_job(model_file, state="COMPLETED", now=now - timedelta(hours=1), deployment=two)
    Job.objects.filter(pk=old.pk).update(
        completion_tokens=999, finished_at=now - timedelta(hours=1)
    )
    got = scrape()
    m = "tiny-model"
    assert v(got, "racon_replicas", model=m) == 2
    assert v(got, "racon_deployment_slots_in_use", deployment=str(one.id), model=m) == 2
    assert v(got, "racon_deployment_slots_free", deployment=str(one.id), model=m) == 2
    assert v(got, "racon_deployment_slots_free", deployment=str(two.id), model=m) == 4
    assert v(got, "racon_model_queue_depth", model=m) == 1
    assert v(got, "racon_model_queue_wait_seconds", model=m) == pytest.approx(3.0, rel=0.05)
    # 120 tokens in the last minute on the first replica; the old job is out of the window.
    assert v(
        got, "racon_replica_tokens_per_second", deployment=str(one.id), model=m
    ) == pytest.approx(2.0)
    assert v(got, "racon_replica_tokens_per_second", deployment=str(two.id), model=m) == 0
