from __future__ import annotations

import re
from pathlib import Path

import pytest

from .runner import processes_under, run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_scheduler_bench_quick_prints_ratios_for_quality_time_and_loopback(tmp_path: Path) -> None:
    proc = run_bench("scheduler.py", ["--quick"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert re.search(
        r"plan_placement / exhaustive_best \(predicted tok/s\): mean \d+\.\d+%", out
    ), out
    assert re.search(r"wall p50 \d+\.\d+x of the 50 ms target", out), out
    for n in (1, 2, 3):
        assert re.search(
            rf"^{n} node\(s\): predicted/measured \d+\.\d\d \(error [+-]\d+%\)", out, re.M
        ), out
    assert "cost-model check" in out
    assert processes_under(tmp_path) == []
