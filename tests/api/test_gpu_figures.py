"""A GPU's measured figures (agent/hardware/gpu_benchmark.py) reach the scheduler's inputs.

The enrollment serializer keeps only the fields it declares: before the GPU entry declared
gflops and mem_bandwidth_gbps they were dropped there, and every GPU got the assumed figures.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from agent.hardware.fake import load_profile
from apps.nodes.api import HardwareSerializer
from tests.agent.harness import fake_profile


def _hardware(tmp_path: Any, **gpu: Any) -> dict[str, Any]:
    profile = load_profile(fake_profile(tmp_path, gpus=[{"vram_total": 80 * 2**30, **gpu}]))
    return dict(profile)


def test_a_measured_gpu_keeps_its_figures_through_enrollment(tmp_path: Any) -> None:
    s = HardwareSerializer(data=_hardware(tmp_path, gflops=40_000.0, mem_bandwidth_gbps=3_000.0))
    assert s.is_valid(), s.errors
    got = s.validated_data["gpus"][0]
    assert (got["gflops"], got["mem_bandwidth_gbps"]) == (40_000.0, 3_000.0)


def test_an_unmeasured_gpu_has_no_figures(tmp_path: Any) -> None:
    s = HardwareSerializer(data=_hardware(tmp_path))
    assert s.is_valid(), s.errors
    assert "gflops" not in s.validated_data["gpus"][0]


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ({"gflops": -1.0}, "gflops"),
        ({"mem_bandwidth_gbps": float("inf")}, "mem_bandwidth_gbps"),
    ],
)
def test_an_implausible_gpu_figure_is_refused_naming_it(
    tmp_path: Any, gpu: dict[str, float], message: str
) -> None:
    s = HardwareSerializer(data=_hardware(tmp_path, **gpu))
    assert not s.is_valid()
    assert message in str(s.errors)


def test_a_gpu_figure_past_the_bound_is_refused(tmp_path: Any) -> None:
    over = settings.NODE_MAX_GFLOPS * 100 + 1
    s = HardwareSerializer(data=_hardware(tmp_path, gflops=over))
    assert not s.is_valid()
    assert "gpus[0].gflops" in str(s.errors)
