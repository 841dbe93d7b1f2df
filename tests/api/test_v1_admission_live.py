"""Admission through the real HTTP path: daphne, the /v1 view, and a primary played at the Redis edge.

Wall-clock bounds here are generous on purpose (a loaded CI machine must not fail them); what they
tell apart is "served" from "wedged", which the old admission path was for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.accounts.models import Account
from apps.api.auth import api_key_create, api_key_revoke
from apps.credits.ledger import account_create, credit_adjust
from apps.jobs import admission
from apps.jobs.models import Deployment, Job
from apps.jobs.states import JobState
from racon import ids
from racon.redis import get_redis
from tests.factories import live_deployment

from .live import Daphne, FakePrimary, run_daphne

pytestmark = pytest.mark.django_db(transaction=True)

OPERATOR = {"Authorization": "Bearer test-operator-key"}
BODY = {
    "model": "live-model",
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 8,
}


@pytest.fixture
def daphne(tmp_path: Path) -> Iterator[Daphne]:
    # Long waits and a long cache TTL: only the behaviour under test can make these tests pass.
    with run_daphne(tmp_path, JOB_QUEUE_WAIT_SECONDS="120", API_CACHE_SECONDS="300") as d:
        yield d


@pytest.fixture
def dep() -> Deployment:
    return live_deployment()


def admission_keys() -> list[str]:
    r = get_redis()
    return sorted(
        k
        for p in ("racon:dep:*:slots", "racon:dep:*:waiting", "racon:dep:*:waitlease")
        for k in r.scan_iter(match=p)
    )


def post_in_thread(
    url: str, headers: dict[str, str], timeout: float, out: dict[str, Any], name: str
) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = httpx.post(
                url + "/v1/chat/completions", json=BODY, headers=headers, timeout=timeout
            )
        except httpx.HTTPError as exc:
            out[name] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_until(predicate: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def key_for(name: str, *, balance: int | None = None) -> tuple[Any, dict[str, str]]:
    acct = account_create(name=name)
    if balance is not None:
        from django.utils import timezone

        credit_adjust(
            account_id=ids.account_id(acct.pk),
            amount=balance - Account.objects.get(pk=acct.pk).balance,
            reason="test setup",
            now=timezone.now(),
        )
    _, key = api_key_create(
        name=f"{name}-key", account_id=ids.account_id(acct.pk), scopes=["inference"]
    )
    return acct.pk, {"Authorization": f"Bearer {key}"}


def test_clients_that_give_up_while_queued_leave_at_once_and_the_next_request_is_served(
    daphne: Daphne, dep: Deployment
) -> None:
    results: dict[str, Any] = {}
    with FakePrimary(node_id=str(dep.primary_id), hold=1) as primary:
        long_one = post_in_thread(daphne.url, OPERATOR, 120, results, "long")
        (long_job,) = primary.wait_started(1)
        quitters = [
            post_in_thread(daphne.url, OPERATOR, 0.8, results, f"quitter-{k}") for k in range(3)
        ]
        wait_until(
            lambda: (
                len(admission.queue_order(deployment_id=ids.deployment_id(dep.id))) == 3
                or all(not t.is_alive() for t in quitters)
            ),
            30,
            "three waiters queued",
        )
        for t in quitters:
            t.join(timeout=30)
        assert all(isinstance(results[f"quitter-{k}"], httpx.TimeoutException) for k in range(3)), (
            results
        )
        # They left at once: not when the long request ends, nor when a lease runs out (10 s).
        left_in = wait_until(
            lambda: admission.queue_order(deployment_id=ids.deployment_id(dep.id)) == [],
            8,
            "the abandoned waiters to leave the queue",
        )
        assert left_in < 8
        wait_until(
            lambda: Job.objects.filter(state=JobState.CANCELLED).count() == 3,
            30,
            "the abandoned jobs to be cancelled",
        )
        primary.release(long_job)
        long_one.join(timeout=60)
        assert results["long"].status_code == 200, results["long"].text
        t0 = time.monotonic()
        nxt = httpx.post(
            daphne.url + "/v1/chat/completions", json=BODY, headers=OPERATOR, timeout=60
        )
        served_in = time.monotonic() - t0
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["choices"][0]["message"]["content"] == "Hello there."
    assert served_in < 50  # the issue asks < 5 s; the bound only tells served from wedged
    # The controller's own count of what it relayed, not the node's claim.
    assert nxt.json()["usage"]["completion_tokens"] == 3
    wait_until(lambda: admission_keys() == [], 10, f"admission keys to be gone: {admission_keys()}")
    assert Job.objects.filter(state=JobState.COMPLETED).count() == 2
    assert not Job.objects.exclude(state__in=[JobState.COMPLETED, JobState.CANCELLED]).exists()


def test_the_queue_is_not_ordered_by_balance(daphne: Daphne, dep: Deployment) -> None:
    poor_account, poor = key_for("poor", balance=200_000)
    rich_account, rich = key_for("rich")  # the starting grant: a standing far above the poor one
    results: dict[str, Any] = {}
    with FakePrimary(node_id=str(dep.primary_id), hold=1) as primary:
        long_one = post_in_thread(daphne.url, OPERATOR, 120, results, "long")
        (long_job,) = primary.wait_started(1)
        threads = [post_in_thread(daphne.url, poor, 120, results, "poor")]
        wait_until(
            lambda: len(admission.queue_order(deployment_id=ids.deployment_id(dep.id))) == 1,
            30,
            "the poor request queued",
        )
        threads.append(post_in_thread(daphne.url, rich, 120, results, "rich"))
        wait_until(
            lambda: len(admission.queue_order(deployment_id=ids.deployment_id(dep.id))) == 2,
            30,
            "the rich request queued",
        )
        primary.release(long_job)
        started = primary.wait_started(3)
        for t in [long_one, *threads]:
            t.join(timeout=60)
    assert all(results[n].status_code == 200 for n in ("long", "poor", "rich")), results
    order = [Job.objects.get(pk=j).account_id for j in started[1:]]
    # Issue 28: a balance buys no priority (lending does, tests/api/test_v1_trust_live.py):
    # neither lent, so the earlier request goes first.
    assert order == [poor_account, rich_account]
    wait_until(lambda: admission_keys() == [], 10, "admission keys to be gone")


def test_a_revoked_key_is_refused_by_another_process_within_a_bound(daphne: Daphne) -> None:
    account, headers = key_for("revokee")
    assert (
        httpx.get(daphne.url + "/v1/models", headers=headers, timeout=30).status_code == 200
    )  # now cached there
    from apps.accounts.models import ApiKey

    api_key_revoke(key_id=ids.api_key_id(ApiKey.objects.get(account_id=account).pk))
    # Daphne caches principals for 300 s here: only the broadcast can make it refuse this soon.
    took = wait_until(
        lambda: (
            httpx.get(daphne.url + "/v1/models", headers=headers, timeout=30).status_code == 401
        ),
        30,
        "the revoked key refused",
    )
    assert took < 30
