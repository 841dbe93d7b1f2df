"""Celery's worker, its pool and its beat run RACON_BACKGROUND_NICE nicer than the request path
(racon/celery.py), however they are started (the setting's bounds: tests/test_settings_bounds.py)."""

from __future__ import annotations

import os

import psutil
import pytest

from tests.e2e.harness import Controller

pytestmark = pytest.mark.e2e


def test_live_worker_pool_and_beat_are_niced(controller: Controller) -> None:
    assert controller.worker is not None
    want = int(controller.env["RACON_BACKGROUND_NICE"]) + os.nice(0)
    worker = psutil.Process(controller.worker.pid)
    tree = [worker, *worker.children(recursive=True)]
    assert len(tree) >= 3, "the worker, its pool and its embedded beat"
    assert {p.pid: p.nice() for p in tree} == {p.pid: want for p in tree}
    # daphne (the request path) keeps the launching process's priority.
    assert {psutil.Process(p.pid).nice() for p in controller.procs} == {os.nice(0)}
