"""Lending policy (issue 18): windows with an injected clock, idle with a fake source, caps in
plans, a node outside its window not planned, bad input naming the field, the service file."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from agent.commands import rpc_threads
from agent.config import ConfigError, parse_run_args
from agent.lending import (
    Caps,
    FakeIdleSource,
    GiB,
    LendingMonitor,
    LendingPolicy,
    PolicyError,
    check_caps,
    lending_open,
    lending_status_path,
    load_policy_file,
    pause_path,
    policy_from_wire,
    window_state,
)
from agent.service import unit_text, verify_unit
from apps.jobs.scheduler import (
    ClusterSnapshot,
    DeviceSnapshot,
    NodeSnapshot,
    PlacementRefused,
    PlacementRequest,
    plan_placement,
)
from apps.jobs.selectors import cluster_snapshot
from apps.models_repo.profile import synthetic_profile
from racon.ids import NodeId
from tests.factories import NodeFactory

TINY = synthetic_profile(
    name="tiny",
    n_layer=30,
    n_embd=576,
    n_head=9,
    n_head_kv=3,
    n_ff=1536,
    n_vocab=49152,
    tied_embeddings=True,
)
NIGHTS = policy_from_wire({"timezone": "Europe/Paris", "windows": ["mon-fri 19:00-08:00"]})


def paris(y: int, mo: int, d: int, h: int, mi: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, tzinfo=ZoneInfo("Europe/Paris"))


# --- windows (injected clock) ---------------------------------------------------------------------


def test_window_open_and_closing_with_injected_clock() -> None:
    # 2025-03-03 is a Monday.
    assert window_state(NIGHTS, paris(2025, 3, 3, 12)) == (False, None)
    is_open, left = window_state(NIGHTS, paris(2025, 3, 3, 20))
    assert is_open and left == 12 * 3600  # until Tuesday 08:00
    # Friday night runs past midnight into Saturday; Saturday night is closed.
    assert window_state(NIGHTS, paris(2025, 3, 8, 7, 30)) == (True, 1800.0)
    assert window_state(NIGHTS, paris(2025, 3, 8, 20))[0] is False
    # The zone is the node's: 20:00 in Paris is 19:00 UTC in winter.
    assert window_state(NIGHTS, datetime(2025, 3, 3, 17, 30, tzinfo=UTC))[0] is False
    assert window_state(NIGHTS, datetime(2025, 3, 3, 18, 30, tzinfo=UTC))[0] is True


def test_no_window_is_always_open() -> None:
    assert window_state(policy_from_wire({}), datetime.now(UTC)) == (True, None)


# --- idle (fake source) ---------------------------------------------------------------------------


def test_idle_only_with_a_fake_idle_source() -> None:
    policy = policy_from_wire({"idle_minutes": 10, "cpu_below": 30})
    now = datetime(2025, 3, 3, 12, tzinfo=UTC)
    idle = FakeIdleSource(idle_seconds=60, cpu_percent=5)
    ok, why = lending_open(policy, now=now, idle=idle)
    assert not ok and "user input" in why
    idle.idle_seconds = 11 * 60
    assert lending_open(policy, now=now, idle=idle) == (True, "")
    idle.cpu_percent = 80
    ok, why = lending_open(policy, now=now, idle=idle)
    assert not ok and "CPU" in why


def test_monitor_pauses_on_closing_window_and_on_the_pause_file(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    clock = [paris(2025, 3, 3, 20)]
    handed: list[str] = []
    mon = LendingMonitor(
        state_dir=tmp_path,
        policy=lambda: NIGHTS,
        idle=None,
        event=lambda name, _msg, data: events.append((name, data)),
        hand_off=lambda: handed or ["job-1"],
        clock=lambda: clock[0],
        every=0,
    )
    mon.step(force=True)
    assert not mon.paused and events == []
    clock[0] = paris(2025, 3, 4, 8, 1)  # the window closed while work runs: a pause, with handoff
    mon.step()
    assert [e[0] for e in events] == ["LENDING_PAUSED", "LENDING_HANDOFF"]
    assert events[0][1]["handoff"] == "failover" and not events[0][1]["manual"]
    clock[0] = paris(2025, 3, 4, 19, 30)
    mon.step()
    assert events[-1][0] == "LENDING_RESUMED"
    pause_path(tmp_path).write_text(json.dumps({"id": "r1", "handoff": "finish"}))
    mon.step()
    assert events[-1] == (
        "LENDING_PAUSED",
        {"handoff": "finish", "reason": "paused by the owner (handoff: finish)", "manual": True},
    )
    status = json.loads(lending_status_path(tmp_path).read_text())
    assert status["paused"] and status["request"] == "r1"


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--window", "mon-fri 19:00-25:00"], "windows[0]"),
        (["--window", "someday 19:00-08:00"], "windows[0]"),
        (["--window", "19-08"], "windows[0]"),
        (["--timezone", "Mars/Olympus"], "timezone"),
        (["--max-threads", "-2"], "caps.threads"),
        (["--handoff", "drop"], "handoff"),
    ],
)
def test_bad_flags_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_run_args(["--controller-url", "http://127.0.0.1:1", *argv], env={})


def test_policy_file_toml_and_unknown_fields(tmp_path: Path) -> None:
    good = tmp_path / "policy.toml"
    good.write_text(
        'timezone = "Europe/Paris"\nwindows = ["weekdays 19:00-08:00"]\nhandoff = "finish"\n'
        "[idle]\nminutes = 5\n[caps]\nram_gb = 2\nthreads = 2\n"
    )
    policy = load_policy_file(good)
    assert policy.caps.ram_bytes == 2 * GiB and policy.idle_minutes == 5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"caps": {"ram_mb": 3}}))
    with pytest.raises(PolicyError, match="caps.ram_mb"):
        load_policy_file(bad)


def test_cap_above_the_machine_is_refused() -> None:
    hw = {"memory": {"total": 8 * GiB}, "cpu": {"logical_cores": 4}, "gpus": []}
    with pytest.raises(PolicyError, match="caps.ram_gb"):
        check_caps(policy_from_wire({"caps": {"ram_bytes": 16 * GiB}}), hw)
    with pytest.raises(PolicyError, match="caps.threads"):
        check_caps(policy_from_wire({"caps": {"threads": 8}}), hw)
    with pytest.raises(PolicyError, match="caps.vram_gb"):
        check_caps(policy_from_wire({"caps": {"vram_bytes": GiB}}), hw)


def test_pause_on_an_agent_that_is_not_running(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "pause", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "not running" in proc.stderr


# --- the controller's planning ---------------------------------------------------------------------


def _node(node_id: str, free: int, **kw: Any) -> NodeSnapshot:
    dev = DeviceSnapshot(NodeId(node_id), "CPU", "cpu", free, 100.0, 20.0)
    return NodeSnapshot(
        NodeId(node_id), node_id, "READY", "10.0.0.1", 50052, (dev,), threads=8, **kw
    )


def test_node_outside_its_window_is_not_planned() -> None:
    snap = ClusterSnapshot(nodes=(_node("day", 16 * GiB, window_open=False),))
    with pytest.raises(PlacementRefused):
        plan_placement(TINY, snap, PlacementRequest())
    snap = ClusterSnapshot(
        nodes=(_node("day", 16 * GiB, window_open=False), _node("night", 16 * GiB))
    )
    plan = plan_placement(TINY, snap, PlacementRequest())
    assert {d.node_id for d in plan.devices} == {"night"}
    assert any("outside their lending window: day" in line for line in plan.explanation)


def test_node_whose_window_ends_soon_is_avoided_and_explained() -> None:
    snap = ClusterSnapshot(
        nodes=(_node("soon", 16 * GiB, window_closes_in=600.0), _node("later", 8 * GiB)),
        min_window_seconds=3600,
    )
    plan = plan_placement(TINY, snap, PlacementRequest())
    assert {d.node_id for d in plan.devices} == {"later"}
    assert any("closes within 3600s" in line and "soon" in line for line in plan.explanation)


@pytest.mark.django_db
def test_caps_show_up_in_the_snapshot_and_plans() -> None:
    node = NodeFactory(state="READY", ram_total=32 * GiB, ram_available=30 * GiB)
    node.lending = {"policy": {"caps": {"ram_bytes": 2 * GiB, "threads": 2}}}
    node.save()
    snap = cluster_snapshot()
    mine = next(n for n in snap.nodes if n.node_id == str(node.id))
    assert mine.devices[0].free_bytes <= 2 * GiB and mine.threads <= 2
    plan = plan_placement(TINY, dataclasses.replace(snap, nodes=(mine,)), PlacementRequest())
    assert sum(d.memory_bytes for d in plan.devices) <= 2 * GiB


@pytest.mark.django_db
def test_a_thread_cap_lends_that_share_of_the_benchmarked_speed() -> None:
    """The compute benchmark ran on the whole machine; the engine gets only the capped threads, so
    the planner must not predict the whole machine's GFLOPS for them (test (b) in tests/cluster).
    The bandwidth benchmark copies with one thread: any cap of one thread or more keeps it."""
    whole = NodeFactory(state="READY", cpu_physical_cores=8, cpu_logical_cores=16)
    capped = NodeFactory(state="READY", cpu_physical_cores=8, cpu_logical_cores=16)
    for n in (whole, capped):
        n.gflops, n.mem_bandwidth_gbps = 200.0, 40.0
    capped.lending = {"policy": {"caps": {"threads": 2}}}
    whole.save()
    capped.save()
    snap = {n.node_id: n for n in cluster_snapshot().nodes}
    full, quarter = snap[str(whole.id)], snap[str(capped.id)]
    assert (full.threads, quarter.threads) == (8, 2)
    assert quarter.devices[0].gflops == pytest.approx(full.devices[0].gflops / 4)
    assert quarter.devices[0].mem_bandwidth_gbps == pytest.approx(
        full.devices[0].mem_bandwidth_gbps
    )
    one = NodeFactory(state="READY", cpu_physical_cores=8, cpu_logical_cores=16)
    one.gflops, one.mem_bandwidth_gbps = 200.0, 40.0
    one.lending = {"policy": {"caps": {"threads": 1}}}
    one.save()
    single = {n.node_id: n for n in cluster_snapshot().nodes}[str(one.id)]
    assert single.devices[0].mem_bandwidth_gbps == pytest.approx(full.devices[0].mem_bandwidth_gbps)
    assert single.devices[0].gflops == pytest.approx(full.devices[0].gflops / 8)


def test_the_rpc_worker_keeps_to_the_thread_cap() -> None:
    assert rpc_threads(0, LendingPolicy(caps=Caps(threads=1))) == 1
    assert rpc_threads(6, LendingPolicy(caps=Caps(threads=2))) == 2
    assert rpc_threads(1, LendingPolicy(caps=Caps(threads=4))) == 1
    assert rpc_threads(3, LendingPolicy()) == 3


# --- the service file -----------------------------------------------------------------------------


def test_service_file_content(tmp_path: Path) -> None:
    text = unit_text(
        flags=["--controller-url", "http://10.0.0.5:8000", "--window", "mon-fri 19:00-08:00"],
        user=True,
        python="/opt/racon/bin/python",
    )
    assert (
        "ExecStart=/opt/racon/bin/python -m agent.cli --foreground --controller-url "
        "http://10.0.0.5:8000 --window 'mon-fri 19:00-08:00'\n" in text
    )
    assert "WantedBy=default.target" in text and "Restart=on-failure" in text
    assert "WantedBy=multi-user.target" in unit_text(flags=[], user=False)
    if shutil.which("systemd-analyze"):
        path = tmp_path / "racon-agent.service"
        path.write_text(unit_text(flags=[], user=True, python=shutil.which("true") or "/bin/true"))
        ok, out = verify_unit(path)
        assert ok, out
