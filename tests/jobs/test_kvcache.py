"""The KV cache coordinator (apps/jobs/kvcache.py): the hash chain, the routing score, ownership
records with their LRU bound, slot pinning, and routing to the owner against the test Redis."""

from __future__ import annotations

import uuid

import pytest
from django.test import override_settings

from agent.commands import CommandError, validate_job
from agent.runtime.server import _completion_body
from apps.jobs import admission, kvcache
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from apps.nodes.models import Event
from racon import ids
from racon.ids import JobId, ModelId
from racon.redis import get_redis
from tests.jobs.helpers import SYSTEM, chat, deployment, kv_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def model() -> Model:
    return kv_model(name="kv-model", sha256="d" * 64)


def finish(route: kvcache.Route, dep: Deployment, job: str, *, tokens: int = 100) -> None:
    kvcache.job_finished(
        route=route,
        job_id=JobId(job),
        deployment_id=ids.deployment_id(dep.id),
        completed=True,
        usage={"prompt_tokens": tokens, "completion_tokens": 10, "prompt_cached": tokens // 2},
        served_slot=None,
    )


def take(route: kvcache.Route, dep: Deployment, job: str) -> int | None:
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId(job), cap=dep.n_parallel
    )
    return kvcache.slot_claim(
        route=route,
        deployment_id=ids.deployment_id(dep.id),
        job_id=JobId(job),
        n_parallel=dep.n_parallel,
    )


def owned_by_first(model: Model) -> tuple[Deployment, Deployment]:
    """Two replicas; the first owns the conversation "hi" (slot 1) after its first turn."""
    a, b = deployment(model), deployment(model)
    chain = kvcache.prefix_chain(model_id=ids.model_id(model.id), kind="chat", params=chat("hi"))
    seed = kvcache.Route(deployment=a, policy="prefix", reason="", chain=chain)
    seed.slot, seed.slot_deployment_id = 1, str(a.id)
    finish(seed, a, "j0")
    return a, b


def test_chain_follow_up_shares_the_earlier_hashes() -> None:
    first = kvcache.prefix_chain(model_id=ModelId("m"), kind="chat", params=chat("hi"))
    second = kvcache.prefix_chain(
        model_id=ModelId("m"), kind="chat", params=chat("hi", "hello", "more")
    )
    assert len(first) == 2 and len(second) == 4
    assert second[:2] == first
    # empty fields do not change the hash; the content, the model and the tools do
    same = chat("hi")
    same["messages"][1]["tool_calls"] = []
    assert kvcache.prefix_chain(model_id=ModelId("m"), kind="chat", params=same) == first
    assert (
        kvcache.prefix_chain(model_id=ModelId("m"), kind="chat", params=chat("ho"))[1] != first[1]
    )
    assert (
        kvcache.prefix_chain(model_id=ModelId("n"), kind="chat", params=chat("hi"))[0] != first[0]
    )
    tools = {**chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert kvcache.prefix_chain(model_id=ModelId("m"), kind="chat", params=tools)[0] != first[0]
    assert (
        len(kvcache.prefix_chain(model_id=ModelId("m"), kind="completion", params={"prompt": "x"}))
        == 1
    )


def test_route_score_weighs_saved_tokens_against_pressure() -> None:
    idle_miss = kvcache.route_score(tokens_saved=0, used=0, waiting=0, n_parallel=2, lam=256)
    busy_hit = kvcache.route_score(tokens_saved=1000, used=2, waiting=1, n_parallel=2, lam=256)
    small_hit_full = kvcache.route_score(tokens_saved=100, used=2, waiting=2, n_parallel=2, lam=256)
    assert busy_hit > idle_miss  # a long prefix is worth a short queue
    assert small_hit_full < idle_miss  # a short prefix is not worth a long one
    assert kvcache.route_score(tokens_saved=0, used=1, waiting=0, n_parallel=4, lam=100) == -25.0


def test_follow_up_routes_to_the_owner_and_its_slot(model: Model) -> None:
    a, b = deployment(model), deployment(model)
    r1 = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("hi"), cached=False
    )
    assert not r1.hit and r1.owner is None
    dep = r1.deployment
    slot = take(r1, dep, "j1")
    assert slot is not None
    admission.slot_release(deployment_id=dep.id, job_id=JobId("j1"))
    finish(r1, dep, "j1")
    for turn in range(3):
        params = chat("hi", "hello", *(["again"] * (2 * turn + 1)))
        r = kvcache.route_request(
            model_id=ids.model_id(model.id), kind="chat", params=params, cached=False
        )
        assert r.hit and r.deployment.id == dep.id and r.owner is not None
        assert r.owner.slot == slot
        job = f"t{turn}"
        assert take(r, dep, job) == slot  # pinned to the slot holding the prefix
        admission.slot_release(deployment_id=dep.id, job_id=JobId(job))
        finish(r, dep, job)
    assert kvcache.stats()["hits"] == 3 and kvcache.stats()["misses"] == 1
    held = kvcache.deployments_held([a.id, b.id])
    assert held[str(dep.id)][0] == 1  # one conversation, its older prefixes forgotten
    assert not Event.objects.filter(kind="KV_OWNERSHIP_MOVED").exists()


def test_a_miss_takes_the_least_recently_used_free_slot(model: Model) -> None:
    dep = deployment(model, n_parallel=2)
    routes = []
    for i, text in enumerate(("one", "two")):
        r = kvcache.route_request(
            model_id=ids.model_id(model.id), kind="chat", params=chat(text), cached=False
        )
        assert take(r, dep, f"j{i}") == i  # empty slots first, then distinct ones
        routes.append(r)
    for i, r in enumerate(routes):
        admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId(f"j{i}"))
        finish(r, dep, f"j{i}")
    r = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("three"), cached=False
    )
    assert take(r, dep, "j3") == 0  # slot 0 was used longest ago
    admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId("j3"))
    finish(r, dep, "j3")
    assert kvcache.stats()["displaced"] == 1
    # "one" lost its slot: a follow-up misses; "two" still hits slot 1
    gone = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("one", "x", "y"), cached=False
    )
    kept = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("two", "x", "y"), cached=False
    )
    assert not gone.hit and kept.hit and kept.owner is not None and kept.owner.slot == 1


def test_the_same_messages_twice_at_once_reuse_both_copies(model: Model) -> None:
    """Two requests with the same messages served at once leave two slots holding them; the owner
    record names the later. The next two at once take the owner's slot and the copy, not an
    empty slot (which would prefill the whole prompt again)."""
    dep = deployment(model, n_parallel=4)
    first = [
        kvcache.route_request(
            model_id=ids.model_id(model.id), kind="chat", params=chat("hi"), cached=False
        )
        for _ in range(2)
    ]
    assert [take(r, dep, f"a{i}") for i, r in enumerate(first)] == [0, 1]
    for i, r in enumerate(first):
        admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId(f"a{i}"))
        finish(r, dep, f"a{i}")
    again = [
        kvcache.route_request(
            model_id=ids.model_id(model.id), kind="chat", params=chat("hi"), cached=False
        )
        for _ in range(2)
    ]
    assert all(r.owner is not None and r.owner.slot == 1 for r in again)
    assert take(again[0], dep, "b0") == 1 and again[0].hit
    assert take(again[1], dep, "b1") == 0  # the copy, not empty slot 2
    assert again[1].hit and again[1].tokens_saved == 110
    assert "a copy of the prefix on slot 0" in again[1].reason
    for i, r in enumerate(again):
        admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId(f"b{i}"))
        finish(r, dep, f"b{i}")
    stats = kvcache.stats()
    assert stats["hits"] == 2 and stats["misses"] == 2 and stats["displaced"] == 0
    # A follow-up still finds its owner; an unrelated request still takes an empty slot.
    follow = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("hi", "x", "y"), cached=False
    )
    assert follow.hit and take(follow, dep, "c0") in (0, 1)
    other = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("ho"), cached=False
    )
    assert take(other, dep, "c1") == 2 and not other.hit


@override_settings(KV_PREFIX_MAX_ENTRIES=3)
def test_lru_bound_evicts_the_oldest_with_one_event(model: Model) -> None:
    deps = [deployment(model, n_parallel=4) for _ in range(2)]
    n = 0
    for dep in deps:
        for s in range(4):
            chain = kvcache.prefix_chain(
                model_id=ids.model_id(model.id), kind="chat", params=chat(f"c{n}")
            )
            route = kvcache.Route(deployment=dep, policy="prefix", reason="", chain=chain)
            route.slot, route.slot_deployment_id = s, str(dep.id)
            finish(route, dep, f"j{n}")
            n += 1
    r = get_redis()
    assert r.zcard(kvcache.LRU_KEY) == 3
    assert r.hlen(kvcache.OWNERS_KEY) == 3
    assert sum(c for c, _ in kvcache.deployments_held([d.id for d in deps]).values()) == 3
    assert kvcache.stats()["evicted"] == 5
    assert Event.objects.filter(kind="KV_OWNERSHIP_EVICTED").count() == 5
    # the newest survive
    newest = kvcache.prefix_chain(model_id=ids.model_id(model.id), kind="chat", params=chat("c7"))
    assert kvcache.owner_lookup(newest) is not None


def test_owner_full_waits_then_falls_back_and_ownership_moves(model: Model) -> None:
    a, b = deployment(model, n_parallel=1), deployment(model, n_parallel=1)
    chain = kvcache.prefix_chain(model_id=ids.model_id(model.id), kind="chat", params=chat("hi"))
    seed = kvcache.Route(deployment=a, policy="prefix", reason="", chain=chain)
    seed.slot, seed.slot_deployment_id = 0, str(a.id)
    finish(seed, a, "j0", tokens=1500)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(a.id), job_id=JobId("other"), cap=1
    )  # the owner is full
    r = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("hi", "ok", "more"), cached=False
    )
    assert r.deployment.id == a.id and r.hit  # 1500 saved tokens outweigh one busy slot
    assert r.affinity_wait > 0 and r.fallback is not None and r.fallback.id == b.id
    other = kvcache.route_fallback(route=r)
    assert other.id == b.id and not r.hit
    assert take(r, b, "j1") == 0
    finish(r, b, "j1")
    moved = Event.objects.get(kind="KV_OWNERSHIP_MOVED")
    assert moved.data["from_deployment"] == str(a.id) and moved.data["to_deployment"] == str(b.id)
    follow = kvcache.route_request(
        model_id=model.id, kind="chat", params=chat("hi", "ok", "more", "x", "y"), cached=False
    )
    assert follow.owner is not None and follow.owner.deployment_id == str(b.id)


def test_an_owner_that_stops_serving_drops_its_state_with_an_event(model: Model) -> None:
    a, b = owned_by_first(model)
    Deployment.objects.filter(pk=a.pk).update(state=DeploymentState.STOPPED)
    r = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("hi", "ok", "more"), cached=False
    )
    assert r.deployment.id == b.id and not r.hit and "dropped" in r.reason
    dropped = Event.objects.get(kind="KV_STATE_DROPPED")
    assert dropped.deployment_id == a.id and dropped.data["conversations"] == 1
    assert kvcache.stats()["dropped"] == 1


def test_round_robin_policy_alternates_and_pins_nothing(model: Model) -> None:
    a, b = deployment(model), deployment(model)
    get_redis().set(kvcache.ROUTING_KEY, "round_robin")
    seen = []
    for _ in range(4):
        r = kvcache.route_request(
            model_id=ids.model_id(model.id), kind="chat", params=chat("hi"), cached=False
        )
        seen.append(str(r.deployment.id))
        assert (
            kvcache.slot_claim(
                route=r,
                deployment_id=r.deployment.id,
                job_id=ids.job_id(uuid.uuid4()),
                n_parallel=2,
            )
            is None
        )
    assert seen[0] != seen[1] and seen[:2] == seen[2:]
    assert set(seen) == {str(a.id), str(b.id)}


def test_run_job_carries_the_slot_to_llama_server() -> None:
    job = validate_job({"deployment_id": "d", "messages": [SYSTEM], "id_slot": 1})
    assert _completion_body(job, "p")["id_slot"] == 1
    assert "id_slot" not in _completion_body(
        validate_job({"deployment_id": "d", "prompt": "x", "kind": "completion"}), "p"
    )
    with pytest.raises(CommandError):
        validate_job({"deployment_id": "d", "messages": [SYSTEM], "id_slot": "0"})


def test_a_drop_before_the_next_turn_is_routed_still_records_the_move(model: Model) -> None:
    # A drain's own step drops the owner's state before the conversation's next turn is routed
    # (make test-load saw it): that turn is a miss, and its end still says where the
    # conversation went from, as when the routing found the owner gone itself.
    a, b = owned_by_first(model)
    assert (
        kvcache.deployment_drop(
            deployment_id=ids.deployment_id(a.id), reason="the replica stopped (drained)"
        )
        == 1
    )
    Deployment.objects.filter(pk=a.pk).update(state=DeploymentState.STOPPED)
    r = kvcache.route_request(
        model_id=ids.model_id(model.id), kind="chat", params=chat("hi", "ok", "more"), cached=False
    )
    assert r.deployment.id == b.id and r.owner is None and not r.hit
    assert take(r, b, "j1") is not None
    finish(r, b, "j1")
    moved = Event.objects.get(kind="KV_OWNERSHIP_MOVED")
    assert moved.data["from_deployment"] == str(a.id) and moved.data["to_deployment"] == str(b.id)
    assert Event.objects.filter(kind="KV_STATE_DROPPED").count() == 1
    # Told once: a later turn of the conversation, now owned by b, moves nothing.
    later = kvcache.route_request(
        model_id=ids.model_id(model.id),
        kind="chat",
        params=chat("hi", "ok", "more", "x", "y"),
        cached=False,
    )
    assert later.owner is not None and later.owner.deployment_id == str(b.id)
