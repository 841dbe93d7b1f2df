"""`racon nodes gpu-challenge` and `gpu-challenge-clear` against a live controller (issue 25): a
failed GPU challenge stands (one 409 line) until the operator clears it."""

from __future__ import annotations

import json

import pytest

from apps.nodes.models import Event, Node
from racon_cli.client import EXIT_API
from tests.factories import NodeFactory, hardware_profile
from tests.support.cli import Run, one_error_line

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

GIB = 1 << 30


def test_a_failed_challenge_stands_until_the_cli_clears_it(racon: Run) -> None:
    gpu = {
        "index": 0, "vendor": "nvidia", "name": "H100 (claimed)", "uuid": "GPU-1",
        "vram_total": 80 * GIB, "vram_free": 80 * GIB, "driver": "x", "device": "CUDA0",
        "gflops": 900_000.0,
    }  # fmt: skip
    hardware = hardware_profile(gpus=[gpu])
    failed = {"device": "CUDA0", "at": "2026-01-01T00:00:00+00:00", "message": "too late"}
    hardware["gpu_challenge"] = {"last_at": failed["at"], "failed": failed}
    NodeFactory(name="claims", hardware=hardware)
    res = racon("nodes", "gpu-challenge", "claims", "--device", "CUDA0")
    assert res.exit_code == EXIT_API
    line = one_error_line(res)
    assert "409" in line and "stands until an operator clears it" in line, line
    res = racon("nodes", "gpu-challenge-clear", "claims")
    assert res.exit_code == 0 and "GPU challenge record of claims cleared" in res.stdout
    assert "gpu_challenge" not in Node.objects.get(name="claims").hardware
    assert Event.objects.filter(node__name="claims", kind="GPU_CHALLENGE_CLEARED").exists()
    res = racon("nodes", "gpu-challenge-clear", "claims", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["cleared"] is False
