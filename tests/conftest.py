from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Iterator
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


# --- live controllers and the flush between transactional tests ---------------------------------
#
# A transaction=True test ends with Django's TRUNCATE of every table. A live controller that
# outlives tests (tests/e2e/harness.LIVE) would race it with its Celery tasks (a sweep, a
# placement step, a settlement): its worker is stopped, and waited for, before such a test's
# teardown, and started again before the next test that uses a live controller. Its daphne stays
# up; it only answers requests.

_USES_LIVE = ("controller", "live")


def _live_controllers() -> list[Any]:
    import sys

    harness = sys.modules.get("tests.e2e.harness")
    return list(harness.LIVE) if harness is not None else []


def _truncates(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("django_db")
    if marker is not None and marker.kwargs.get("transaction"):
        return True
    return "transactional_db" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if any(name in getattr(item, "fixturenames", ()) for name in _USES_LIVE):
        for ctl in _live_controllers():
            ctl.worker_up()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _truncates(item):
        for ctl in _live_controllers():
            ctl.worker_down()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        import sys

        harness = sys.modules.get("tests.e2e.harness")
        if harness is not None:
            for title, text in harness.failure_sections():
                report.sections.append((title, text))
    return report


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
