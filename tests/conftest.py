from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _clean_redis(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each controller test starts with an empty (test-only) Redis database."""
    if "tests/agent" in str(request.node.path):
        yield  # agent tests manage their own keys and must not need Django
        return
    from racon import cache
    from racon.redis import get_redis

    r = get_redis()
    r.flushdb()
    # The in-process caches (principal, model, route) outlive a test's rolled-back rows.
    cache.clear_local(cache.ALL)
    yield
    r.flushdb()


@pytest.fixture
def now() -> Any:
    from django.utils import timezone

    return timezone.now()


# --- the flush between transactional tests ---------------------------------------------------
#
# A transaction=True test ends with Django's TRUNCATE of every table. A thread that outlived its
# test (a request's background finish, a pool thread) can still hold a lock then: PostgreSQL
# answers "deadlock detected" and Django reports only "couldn't be flushed". The flush is retried
# (bounded), and each failure prints what it met: the database error, the threads still alive
# and the other sessions on the test database. It never changes what a test asserts.

FLUSH_TRIES = 4


def _flush_diagnostics(exc: BaseException) -> str:
    import threading

    from django.db import connection

    lines = [f"flush failed: {exc!r}; cause: {exc.__cause__!r}"]
    lines.append("threads: " + ", ".join(sorted(t.name for t in threading.enumerate())))
    if connection.vendor == "postgresql":
        try:
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT pid, state, wait_event_type, left(query, 160) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                lines += [f"session {row}" for row in cur.fetchall()]
        except Exception as err:  # diagnostics only
            lines.append(f"pg_stat_activity unreadable: {err!r}")
    return "\n".join(lines)


def pytest_configure(config: pytest.Config) -> None:
    import os
    import time

    from django.core.management.base import CommandError
    from django.test import TransactionTestCase

    flush = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]  # Django's own

    def fixture_teardown(self: TransactionTestCase) -> None:
        for attempt in range(1, FLUSH_TRIES + 1):
            try:
                flush(self)
                return
            except CommandError as exc:
                test = os.environ.get("PYTEST_CURRENT_TEST", "?")
                print(f"\n[tests] {test}: flush attempt {attempt}\n{_flush_diagnostics(exc)}")
                if attempt == FLUSH_TRIES:
                    raise
                time.sleep(attempt)

    TransactionTestCase._fixture_teardown = fixture_teardown  # type: ignore[attr-defined]


# --- suite time per area (the README's table) ----------------------------------------------------

_AREA_SECONDS: defaultdict[str, float] = defaultdict(float)
_AREA_TESTS: defaultdict[str, int] = defaultdict(int)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum setup, call and teardown per area (tests/<area>); a session fixture's start counts in
    the area of the first test that needed it."""
    parts = report.nodeid.split("::")[0].split("/")
    area = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    _AREA_SECONDS[area] += report.duration
    if report.when == "call":
        _AREA_TESTS[area] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_AREA_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", "suite time per area")
    for area, seconds in sorted(_AREA_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{area:<24} {_AREA_TESTS[area]:>5} tests {seconds:>9.1f} s")
