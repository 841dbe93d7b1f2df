from __future__ import annotations

import re
from pathlib import Path

import pytest

from .runner import processes_under, run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_gateway_bench_quick_prints_ratios_and_stops_everything(tmp_path: Path) -> None:
    proc = run_bench("gateway.py", ["--quick"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert re.search(
        r"tokens/s RACoN / direct \(decode, client side\): median of paired ratios \d+\.\d{3}", out
    ), out
    assert re.search(
        r"added TTFT, RACoN - direct \(paired\): p50 [+-]\d+\.\d ms\s+p90 [+-]\d+\.\d ms", out
    ), out
    assert re.search(r"end-to-end tokens/s RACoN / direct .*median \d+\.\d{3}", out), out
    assert "where RACoN's time goes" in out and "= RACoN client TTFT" in out
    assert re.search(r"identical output text in \d+/2 pairs", out), out
    assert "load average" in out
    assert processes_under(tmp_path) == []
