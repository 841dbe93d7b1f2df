"""The in-process caches (racon/cache.py): read-through, bounded by the TTL, cleared across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from apps.api.auth import api_key_create, api_key_revoke, principal_for_key
from apps.credits.ledger import account_create
from apps.jobs import selectors
from apps.jobs.deployments import deployment_stop
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model, ModelFile
from racon import cache, ids
from tests.factories import NodeFactory
from tests.support.processes import stop

from .live import ROOT, database_url

SCRIPT = """
import sys
import django
django.setup()
from apps.jobs import selectors
from racon import cache
from racon import ids
assert cache.subscriber_ready(timeout=20), "no subscriber"
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "route":
        ids = [str(d.id) for d in selectors.deployment_route_candidates(model_id=arg, cached=True)]
        print(",".join(ids) or "-", flush=True)
    elif cmd == "hits":
        print(cache.cache(selectors.ROUTE_CACHE).hits, flush=True)

"""


class Other:
    """A second controller process (Django set up on the same database and Redis), asked over stdin."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture
def other_process(tmp_path: Path) -> Iterator[Other]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "racon.settings",
        "API_CACHE_SECONDS": "300",
        "RACON_VAR_DIR": str(tmp_path / "var"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield Other(proc)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        stop(proc)


def ready_deployment() -> Deployment:
    m = Model.objects.create(name="cache-model")
    mf = ModelFile.objects.create(model=m, file_name="c.gguf", sha256="e" * 64, size=1)
    node = NodeFactory()
    return Deployment.objects.create(
        model=m, model_file=mf, state=DeploymentState.READY, primary=node, plan={"devices": []}
    )


@pytest.mark.django_db(transaction=True)
def test_a_stopped_deployment_leaves_another_processs_route_within_a_bound(
    other_process: Other,
) -> None:
    dep = ready_deployment()
    # The broadcasts of this test's own writes may still be in flight: ask until a read is a hit,
    # which shows the other process serves from its cache, not the database.
    for _ in range(100):
        hits = int(other_process.ask("hits"))
        assert other_process.ask(f"route {dep.model_id}") == str(dep.id)
        if int(other_process.ask("hits")) > hits:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the other process never served the route from its cache")
    deployment_stop(deployment_id=ids.deployment_id(dep.id), now=timezone.now())
    # Its TTL is 300 s: only the broadcast can make it see the stop this soon.
    t0 = time.monotonic()
    while other_process.ask(f"route {dep.model_id}") != "-":
        assert time.monotonic() - t0 < 30, "the other process still routes to a stopped deployment"
        time.sleep(0.05)


@pytest.fixture
def subscribed() -> None:
    assert cache.subscriber_ready(timeout=20)


@pytest.mark.django_db
def test_a_change_the_broadcast_missed_is_seen_after_the_ttl(
    settings: Any, subscribed: None
) -> None:
    settings.API_CACHE_SECONDS = 0.3
    dep = ready_deployment()
    assert [
        d.id
        for d in selectors.deployment_route_candidates(
            model_id=ids.model_id(dep.model_id), cached=True
        )
    ] == [dep.id]
    Deployment.objects.filter(pk=dep.pk).update(
        state=DeploymentState.STOPPED
    )  # no signal, no broadcast
    assert [
        d.id
        for d in selectors.deployment_route_candidates(
            model_id=ids.model_id(dep.model_id), cached=True
        )
    ] == [dep.id]
    time.sleep(0.4)
    assert (
        selectors.deployment_route_candidates(model_id=ids.model_id(dep.model_id), cached=True)
        == []
    )


@pytest.mark.django_db
def test_a_revoked_or_new_key_is_seen_at_once_in_the_process_that_wrote_it(
    subscribed: None,
) -> None:
    acct = account_create(name="cache-acct")
    key, plaintext = api_key_create(
        name="k", account_id=ids.account_id(acct.pk), scopes=["inference"]
    )
    assert principal_for_key(plaintext) is not None
    assert principal_for_key(plaintext) is not None
    assert cache.cache("principal").hits >= 1
    api_key_revoke(key_id=ids.api_key_id(key.pk))
    assert principal_for_key(plaintext) is None
    assert principal_for_key("rk_unknown") is None
    _, second = api_key_create(name="k2", account_id=ids.account_id(acct.pk), scopes=["inference"])
    assert principal_for_key(second) is not None


@pytest.mark.django_db
def test_a_zero_ttl_turns_the_caches_off(settings: Any, subscribed: None) -> None:
    settings.API_CACHE_SECONDS = 0
    calls: list[int] = []
    for _ in range(3):
        cache.cached("probe", "k", lambda: calls.append(1))
    assert len(calls) == 3


def test_an_invalidation_during_a_load_keeps_the_stale_value_out(subscribed: None) -> None:
    c = cache.cache("race")
    c.clear()

    def load() -> str:
        c.clear()  # a write committed (and was broadcast) while this read was in flight
        return "stale"

    assert c.get("k", load) == "stale"
    assert c.get("k", lambda: "fresh") == "fresh"


def test_the_cache_is_bounded(subscribed: None) -> None:
    c = cache.TtlCache("bounded", max_entries=10)
    for k in range(100):
        c.get(k, lambda: None)
    assert len(c) <= 10


def _burst(c: cache.TtlCache, n: int, loader: Any, release: threading.Event) -> list[Any]:
    """n readers of one key at once; ``release`` is set once all n have missed (the loader holds
    on it). Returns what each reader got (or the exception it raised)."""
    got: list[Any] = []

    def read() -> None:
        try:
            got.append(c.get("k", loader))
        except Exception as exc:  # the test looks at it
            got.append(exc)

    def all_missed() -> None:
        deadline = time.monotonic() + 30
        while c.misses < n and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()

    threads = [threading.Thread(target=all_missed)]
    threads += [threading.Thread(target=read) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_a_burst_of_misses_loads_once(subscribed: None) -> None:
    """The requests of a burst that miss together wait for one load (single flight)."""
    c = cache.TtlCache("burst")
    release = threading.Event()
    calls: list[int] = []

    def load() -> str:
        calls.append(1)
        release.wait(30)  # held until every reader has missed
        return "row"

    got = _burst(c, 8, load, release)
    assert got == ["row"] * 8 and len(calls) == 1 and c.misses == 8
    assert c.get("k", lambda: "again") == "row"  # cached


def test_a_failed_load_lets_the_waiters_load_themselves(subscribed: None) -> None:
    c = cache.TtlCache("failing")
    release = threading.Event()
    calls: list[int] = []

    def load() -> str:
        calls.append(1)
        if len(calls) == 1:
            release.wait(30)
            raise RuntimeError("database went away")
        return "row"

    got = _burst(c, 4, load, release)
    assert sum(isinstance(g, RuntimeError) for g in got) == 1
    assert [g for g in got if not isinstance(g, Exception)] == ["row"] * 3 and len(calls) == 4


def test_a_miss_after_an_invalidation_does_not_wait_for_the_older_load(subscribed: None) -> None:
    c = cache.TtlCache("inflight")
    started, release = threading.Event(), threading.Event()

    def old() -> str:
        started.set()
        release.wait(30)
        return "old"

    first = _load_in_background(c, old)
    assert started.wait(30)
    c.clear()  # a write committed while the old load ran
    assert c.get("k", lambda: "new") == "new"  # loads anew instead of taking the old value
    release.set()
    first.join(30)
    assert c.get("k", lambda: "later") == "new"  # the old load was kept out of the cache


def _load_in_background(c: cache.TtlCache, loader: Any) -> threading.Thread:
    t = threading.Thread(target=lambda: c.get("k", loader))
    t.start()
    return t
