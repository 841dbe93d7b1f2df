"""Celery's worker, its pool and its beat run RACON_BACKGROUND_NICE nicer than the request path
(racon/celery.py), however they are started; the setting is checked at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests.e2e.harness import ROOT, Controller

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


def _settings_import(value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "racon.settings"}
    env["RACON_BACKGROUND_NICE"] = value
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("value", ["-5", "20", "ten"])
def test_bad_setting_is_refused_by_name(value: str) -> None:
    done = _settings_import(value)
    assert done.returncode != 0
    assert "ImproperlyConfigured: RACON_BACKGROUND_NICE=" in done.stderr and value in done.stderr
