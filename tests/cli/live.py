"""One live controller (daphne + Celery) shared by the CLI, TUI and browser tests of a session.

Each of their conftests has its own session fixture; they all hand back this one controller, so a
run of tests/cli, tests/tui and tests/ui starts a single one. It stops when the session ends,
before the test database is dropped (the fixtures depend on django_db_setup).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e.harness import Controller, run_controller, shared

_shared: dict[str, Controller] = {}


def shared_controller(
    request: pytest.FixtureRequest, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Controller:
    if "ctl" in _shared:
        return _shared["ctl"]
    stack = ExitStack()
    with django_db_blocker.unblock():
        ctl = stack.enter_context(
            run_controller(
                tmp_path_factory.mktemp("live-controller"),
                # It outlives each test: its worker stops for each flush (tests/conftest.py), and
                # runs no beat, so no periodic task touches factory-made rows.
                worker="tasks",
                # Factory-made nodes send no heartbeats: wide windows keep them READY for any
                # reader that ages them. Real agents heartbeat every second either way.
                HEARTBEAT_DEGRADED_AFTER="600",
                HEARTBEAT_OFFLINE_AFTER="1200",
            )
        )
    stack.enter_context(shared(ctl))
    _shared["ctl"] = ctl

    def stop() -> None:
        _shared.pop("ctl", None)
        stack.close()

    request.addfinalizer(stop)
    return ctl
