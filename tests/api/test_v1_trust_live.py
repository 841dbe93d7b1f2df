"""Issue 28 (trust, second round) through the real HTTP path: daphne, the /v1 view, admission,
the credit hold and settlement (eager Celery), with the primary played at the Redis edge.

Each test performs what a user (or a hostile key holder) would do and asserts on the ledger,
the queue or the answer; wall-clock bounds are generous (served against wedged, never speed).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from agent.protocol import job_stream_key, node_queue_key
from apps.accounts.models import Account
from apps.api.auth import api_key_create
from apps.credits.ledger import account_create, credit_adjust
from apps.credits.models import Entry, EntryKind
from apps.jobs.models import Deployment, Job
from apps.jobs.states import JobState
from racon import ids
from racon.redis import get_redis
from tests.factories import NodeFactory, live_deployment

from .live import Daphne, FakePrimary, run_daphne

pytestmark = pytest.mark.django_db(transaction=True)

N_CTX = 4096
MICRO = 1_000  # CREDITS_MICRO_PER_TOKEN's default; the model's price weight is 1000 permille


class PromptPrimary(FakePrimary):
    """A primary that answers one token and reports ``prompt`` prompt tokens."""

    def __init__(self, node_id: str, *, prompt: int, hold: int = 0) -> None:
        super().__init__(node_id=node_id, hold=hold)
        self.prompt = prompt

    def _serve(self, job_id: str, release: threading.Event) -> None:
        r = get_redis()
        key = job_stream_key(job_id, self.node_id)
        release.wait(60)
        r.xadd(
            key,
            {"seq": "0", "attempt": "1", "type": "chunk", "text": "Hi", "ids": "[9906]", "n": "1"},
        )
        usage = json.dumps({"prompt_tokens": self.prompt, "completion_tokens": 1, "ttft_ms": 5.0})
        r.xadd(
            key,
            {
                "seq": "1",
                "attempt": "1",
                "type": "done",
                "text": "",
                "finish_reason": "length",
                "usage": usage,
            },
        )


@pytest.fixture
def daphne(tmp_path: Path) -> Iterator[Daphne]:
    with run_daphne(tmp_path, JOB_QUEUE_WAIT_SECONDS="120", API_CACHE_SECONDS="300") as d:
        yield d


@pytest.fixture
def dep() -> Deployment:
    return live_deployment(n_ctx=N_CTX)


def key_for(name: str, *, balance: int | None = None) -> tuple[Any, dict[str, str]]:
    acct = account_create(name=name)
    if balance is not None:
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


def chat(url: str, headers: dict[str, str], content: str, max_tokens: int) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "live-model",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        },
        headers=headers,
        timeout=120,
    )


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.05)


def settled(job_id: Any) -> Entry:
    wait_until(
        lambda: Entry.objects.filter(kind=EntryKind.SETTLE, job_id=job_id).exists(),
        60,
        f"job {job_id} settled",
    )
    return Entry.objects.get(kind=EntryKind.SETTLE, job_id=job_id)


# --- billing: the prompt is held for and charged ---------------------------------------------------


def test_a_2000_token_prompt_with_max_tokens_1_is_charged_for_both(
    daphne: Daphne, dep: Deployment
) -> None:
    account, headers = key_for("prompter")
    before = Account.objects.get(pk=account).balance
    with PromptPrimary(str(dep.primary_id), prompt=2000):
        resp = chat(daphne.url, headers, "word " * 2000, max_tokens=1)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 2000
    job = Job.objects.get(account_id=account)
    assert job.state == JobState.COMPLETED
    reserve = Entry.objects.get(kind=EntryKind.RESERVE, job_id=job.pk)
    # The hold covers the prompt's bound (its 10,000 bytes, cut to the slot's n_ctx less
    # max_tokens) plus max_tokens.
    assert reserve.data["prompt_tokens"] == N_CTX - 1, reserve.data
    entry = settled(job.pk)
    assert entry.data["charged"] == (2000 + 1) * MICRO, entry.data
    assert entry.data["uncharged"] == 0, entry.data
    assert Account.objects.get(pk=account).balance == before - (2000 + 1) * MICRO


def test_a_megabyte_prompt_holds_at_most_the_slots_context_not_a_million_tokens(
    daphne: Daphne, dep: Deployment
) -> None:
    # Enough for the hold of a whole slot, far too little for a million tokens.
    account, headers = key_for("bulky", balance=(N_CTX + 10) * MICRO)
    with PromptPrimary(str(dep.primary_id), prompt=N_CTX - 8):
        resp = chat(daphne.url, headers, "x" * (1024 * 1024), max_tokens=8)
    assert resp.status_code == 200, resp.text
    job = Job.objects.get(account_id=account)
    reserve = Entry.objects.get(kind=EntryKind.RESERVE, job_id=job.pk)
    assert reserve.data["prompt_tokens"] == N_CTX - 8, reserve.data
    entry = settled(job.pk)
    assert entry.data["charged"] == (N_CTX - 8 + 1) * MICRO, entry.data


# --- keys and the API: balance before the prompt leaves, limits per key ---------------------------


def test_a_key_with_no_balance_never_pushes_its_prompt_to_the_primary(
    daphne: Daphne, dep: Deployment
) -> None:
    account, headers = key_for("broke", balance=0)
    with PromptPrimary(str(dep.primary_id), prompt=10) as primary:
        resp = chat(daphne.url, headers, "a secret the node must not see", max_tokens=8)
        time.sleep(1.0)  # what the primary would have taken off its queue by now
        got = list(primary.started)
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
    assert got == []  # the prompt never reached the node
    assert get_redis().llen(node_queue_key(str(dep.primary_id))) == 0
    assert not Job.objects.filter(account_id=account).exists()


def set_limits(url: str, key_id: Any, **limits: int | None) -> None:
    resp = httpx.post(
        f"{url}/api/admin/keys/{key_id}/limits",
        json=limits,
        headers={"Authorization": "Bearer test-operator-key"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert all(resp.json()["effective"][k] == v for k, v in limits.items() if v is not None)


def key_id_of(account: Any) -> Any:
    from apps.accounts.models import ApiKey

    return ApiKey.objects.get(account_id=account).pk


def test_a_key_over_its_concurrency_cap_gets_429_with_retry_after_and_frees_at_the_end(
    daphne: Daphne, dep: Deployment
) -> None:
    account, headers = key_for("swarm")
    set_limits(daphne.url, key_id_of(account), max_concurrent=1)
    results: dict[str, Any] = {}
    with PromptPrimary(str(dep.primary_id), prompt=3, hold=1) as primary:

        def first() -> None:
            results["first"] = chat(daphne.url, headers, "one", max_tokens=4)

        t = threading.Thread(target=first, daemon=True)
        t.start()
        (job,) = primary.wait_started(1)
        over = chat(daphne.url, headers, "two", max_tokens=4)
        assert over.status_code == 429, over.text
        body = over.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        assert body["code"] == "concurrency_limit_exceeded" and body["type"] == "requests"
        assert int(over.headers["Retry-After"]) >= 1
        assert "1 requests at once" in body["message"]
        primary.release(job)
        t.join(timeout=60)
        assert results["first"].status_code == 200, results["first"].text
        # The first one's end gave its place back.
        again = chat(daphne.url, headers, "three", max_tokens=4)
        assert again.status_code == 200, again.text
        # A streamed answer gives its place back when the stream ends, too.
        with httpx.stream(
            "POST",
            daphne.url + "/v1/chat/completions",
            json={
                "model": "live-model",
                "messages": [{"role": "user", "content": "four"}],
                "max_tokens": 4,
                "stream": True,
            },
            headers=headers,
            timeout=120,
        ) as streamed:
            assert streamed.status_code == 200
            body = "".join(streamed.iter_text())
        assert "[DONE]" in body, body
        last = chat(daphne.url, headers, "five", max_tokens=4)
    assert last.status_code == 200, last.text
    # The refused request left nothing behind: no job, no hold.
    assert Job.objects.filter(account_id=account).count() == 4


def test_a_key_over_its_requests_or_tokens_per_minute_gets_429_rate_limit_exceeded(
    daphne: Daphne, dep: Deployment
) -> None:
    account, headers = key_for("chatty")
    set_limits(daphne.url, key_id_of(account), requests_per_minute=2)
    with PromptPrimary(str(dep.primary_id), prompt=3):
        codes = [chat(daphne.url, headers, f"q{i}", max_tokens=4) for i in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429], [r.text for r in codes]
        over = codes[2]
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        assert over.json()["error"]["type"] == "requests"
        # One request comes back every 30 s at 2 a minute.
        assert 1 <= int(over.headers["Retry-After"]) <= 30
        # Tokens: the bucket holds 1,000 a minute; each request takes its prompt's bound plus
        # max_tokens, so the second 600-token request must wait.
        set_limits(daphne.url, key_id_of(account), requests_per_minute=0, tokens_per_minute=1000)
        first = chat(daphne.url, headers, "x", max_tokens=600)
        second = chat(daphne.url, headers, "y", max_tokens=600)
    assert first.status_code == 200, first.text
    assert second.status_code == 429 and second.json()["error"]["type"] == "tokens", second.text
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(second.headers["Retry-After"]) >= 1


# --- priority follows contribution ------------------------------------------------------------------


@pytest.fixture
def daphne_priority(tmp_path: Path) -> Iterator[Daphne]:
    # A 4 s bound and a small half-point, so that a lender's bonus is nearly the whole bound.
    with run_daphne(
        tmp_path,
        JOB_QUEUE_WAIT_SECONDS="120",
        API_CACHE_SECONDS="300",
        PRIORITY_MAX_WAIT_SECONDS="4",
        PRIORITY_STANDING_HALF="1000",
    ) as d:
        yield d


def lend(account: Any) -> None:
    """The account's node serves a job and is paid for it, as settlement does."""
    from apps.credits.settlement import credit_reserve, credit_settle_job
    from tests.factories import deployment_for, funded_account, job_finish, job_for

    node = NodeFactory(account=Account.objects.get(pk=account))
    dep = deployment_for([(node, 4)])
    consumer = funded_account(10**7)
    job = job_for(account=consumer, model=dep.model, deployment=dep, max_tokens=50)
    now = timezone.now()
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=50,
        model_price_permille=1000,
        now=now,
    )
    job_finish(job, completion=50)
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)


def queue_len(dep: Deployment) -> int:
    from apps.jobs import admission

    return len(admission.queue_order(deployment_id=ids.deployment_id(dep.id)))


def test_the_lender_is_served_first_under_contention_and_the_other_within_the_bound(
    daphne_priority: Daphne, dep: Deployment
) -> None:
    url = daphne_priority.url
    lender, lender_h = key_for("lender")
    other, other_h = key_for("rich", balance=10**12)  # far more credits, lent nothing
    lend(lender)
    operator = {"Authorization": "Bearer test-operator-key"}
    results: dict[str, Any] = {}

    def post(name: str, headers: dict[str, str]) -> threading.Thread:
        def run() -> None:
            results[name] = chat(url, headers, name, max_tokens=4)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    with PromptPrimary(str(dep.primary_id), prompt=3, hold=10) as primary:
        # Contention: the one slot is busy; the other queues first, the lender just after.
        busy = post("busy", operator)
        (busy_job,) = primary.wait_started(1)
        threads = [post("other-1", other_h)]
        wait_until(lambda: queue_len(dep) == 1, 30, "the other account's request queued")
        threads.append(post("lender-1", lender_h))
        wait_until(lambda: queue_len(dep) == 2, 30, "the lender's request queued")
        primary.release(busy_job)
        started = primary.wait_started(2)
        # The lender's later request went first; the other is served right after it.
        assert Job.objects.get(pk=started[1]).account_id == lender, "the lender was not first"
        primary.release(started[1])
        started = primary.wait_started(3)
        assert Job.objects.get(pk=started[2]).account_id == other
        # Bounded: once the other has waited PRIORITY_MAX_WAIT_SECONDS (4 s), a lender arriving
        # later no longer goes ahead of it.
        threads.append(post("other-2", other_h))
        wait_until(lambda: queue_len(dep) == 1, 30, "the other account's second request queued")
        time.sleep(5)
        threads.append(post("lender-2", lender_h))
        wait_until(lambda: queue_len(dep) == 2, 30, "the lender's second request queued")
        primary.release(started[2])
        started = primary.wait_started(4)
        assert Job.objects.get(pk=started[3]).account_id == other
        primary.release(started[3])
        started = primary.wait_started(5)
        assert Job.objects.get(pk=started[4]).account_id == lender
        primary.release(started[4])
        for t in [busy, *threads]:
            t.join(timeout=60)
    assert all(r.status_code == 200 for r in results.values()), {
        k: r.text for k, r in results.items()
    }


def test_an_accounts_limit_holds_over_all_its_keys(daphne: Daphne, dep: Deployment) -> None:
    account, first_key = key_for("many-keys")
    _, other = api_key_create(name="second", account_id=account, scopes=["inference"])
    second_key = {"Authorization": f"Bearer {other}"}
    resp = httpx.post(
        f"{daphne.url}/api/admin/accounts/{account}/limits",
        json={"max_concurrent": 1},
        headers={"Authorization": "Bearer test-operator-key"},
        timeout=30,
    )
    assert resp.status_code == 200 and resp.json()["effective"]["max_concurrent"] == 1, resp.text
    results: dict[str, Any] = {}
    with PromptPrimary(str(dep.primary_id), prompt=3, hold=1) as primary:

        def first() -> None:
            results["first"] = chat(daphne.url, first_key, "one", max_tokens=4)

        t = threading.Thread(target=first, daemon=True)
        t.start()
        (job,) = primary.wait_started(1)
        over = chat(daphne.url, second_key, "two", max_tokens=4)
        primary.release(job)
        t.join(timeout=60)
    assert results["first"].status_code == 200, results["first"].text
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert "for this account" in over.json()["error"]["message"]
    assert int(over.headers["Retry-After"]) >= 1
