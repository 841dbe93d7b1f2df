"""The owner's lending policy from the controller's UI on the agent: the set_lending command
applies it, keeps it in the state dir, and a restart starts with it (agent/lending.py:
owner_policy_save, owner_policy_at_start). A real Agent with the fake runtime and controller."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from agent.agent import EXIT_CONFIG
from agent.lending import (
    GiB,
    LendingPolicy,
    PolicyError,
    owner_policy_at_start,
    owner_policy_path,
    owner_policy_save,
    policy_from_wire,
)
from tests.agent.harness import Harness, wait

OWNERS = policy_from_wire(
    {
        "timezone": "Europe/Paris",
        "windows": ["mon-fri 19:00-08:00"],
        "idle_minutes": 10,
        "caps": {"ram_bytes": 8 * GiB, "threads": 4},
        "handoff": "finish",
    }
)
MACHINE = {"memory": {"total": 32 * GiB}, "cpu": {"logical_cores": 16}, "gpus": []}


def test_set_lending_applies_the_owners_policy_and_a_restart_keeps_it(h: Harness) -> None:
    cfg = h.config()
    agent = h.start(cfg)
    wire = OWNERS.to_wire()
    result = h.controller.result(h.send(agent, "set_lending", {"lending": wire}))
    assert result["ok"] and result["lending"] == wire, result
    assert agent.config.lending == OWNERS  # the lending monitor reads it from its next look
    adopted = h.controller.wait_for(lambda c: c.events("LENDING_POLICY"))
    assert adopted[-1]["data"]["lending"] == wire  # the controller records it as adopted
    saved = owner_policy_path(cfg.state_dir)
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert json.loads(saved.read_text())["policy"] == wire
    assert h.stop(agent) == 0

    # The same command line again (no --policy, no flags): the owner's policy, not the default.
    cfg.lending = LendingPolicy()
    cfg.enrollment_token = None
    second = h.start(cfg)
    assert second.config.lending == OWNERS
    reported = h.controller.wait_for(lambda c: c.events("HARDWARE_UPDATED"))
    assert reported[-1]["data"]["lending"] == wire


def test_an_owners_policy_the_machine_cannot_honour_is_refused_and_not_kept(h: Harness) -> None:
    cfg = h.config()
    agent = h.start(cfg)
    too_big = policy_from_wire({"caps": {"ram_bytes": 64 * GiB}}).to_wire()  # the machine: 32 GB
    result = h.controller.result(h.send(agent, "set_lending", {"lending": too_big}))
    assert not result["ok"] and "caps.ram_gb" in result["error"], result
    bad = h.controller.result(h.send(agent, "set_lending", {"lending": {"windows": ["nightly"]}}))
    assert not bad["ok"] and "windows[0]" in bad["error"], bad
    missing = h.controller.result(h.send(agent, "set_lending", {}))
    assert not missing["ok"] and "lending: must be an object" in missing["error"], missing
    assert agent.config.lending == LendingPolicy()
    assert not owner_policy_path(cfg.state_dir).exists()
    assert len(h.controller.wait_for(lambda c: c.events("LENDING_POLICY_REFUSED"))) == 3


def test_changed_flags_after_the_owners_policy_win_and_drop_it(h: Harness) -> None:
    cfg = h.config()
    agent = h.start(cfg)
    result = h.controller.result(h.send(agent, "set_lending", {"lending": OWNERS.to_wire()}))
    assert result["ok"], result
    assert h.stop(agent) == 0
    flags = policy_from_wire({"windows": ["22:00-06:00"]})  # the owner edited the flags since
    cfg.lending, cfg.enrollment_token = flags, None
    second = h.start(cfg)
    assert second.config.lending == flags
    assert not owner_policy_path(cfg.state_dir).exists()


def test_a_kept_policy_above_the_machine_stops_the_agent_naming_the_file(h: Harness) -> None:
    cfg = h.config()
    owner_policy_save(
        cfg.state_dir,
        policy_from_wire({"caps": {"threads": 64}}),  # the machine has 16
        configured=cfg.lending,
    )
    agent = h.start(cfg, wait=False)
    code = wait(lambda: next((box.get("code") for a, _, box in h.agents if a is agent), None))
    assert code == EXIT_CONFIG


# --- the pure part ------------------------------------------------------------------------------


def test_the_kept_policy_is_used_only_while_the_configured_one_is_unchanged(tmp_path: Path) -> None:
    configured = policy_from_wire({"timezone": "UTC", "windows": ["09:00-17:00"]})
    assert owner_policy_at_start(tmp_path, configured) == (configured, None)
    path = owner_policy_save(tmp_path, OWNERS, configured=configured)
    assert owner_policy_at_start(tmp_path, configured, hardware=MACHINE) == (OWNERS, path)
    # A second owner's policy keeps the first base: what the file and flags gave.
    newer = policy_from_wire({"caps": {"threads": 2}})
    owner_policy_save(tmp_path, newer, configured=OWNERS)
    assert owner_policy_at_start(tmp_path, configured) == (newer, path)
    assert owner_policy_at_start(tmp_path, LendingPolicy()) == (LendingPolicy(), None)
    assert not path.exists()


def test_a_broken_or_oversized_kept_policy_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = owner_policy_path(tmp_path)
    path.write_text("{not json")
    with pytest.raises(PolicyError, match="owner-lending.json"):
        owner_policy_at_start(tmp_path, LendingPolicy())
    owner_policy_save(
        tmp_path, policy_from_wire({"caps": {"ram_bytes": 64 * GiB}}), configured=LendingPolicy()
    )
    with pytest.raises(PolicyError) as exc:
        owner_policy_at_start(tmp_path, LendingPolicy(), hardware=MACHINE)
    assert str(path) in str(exc.value) and "caps.ram_gb" in str(exc.value)


def test_a_policy_error_names_its_field() -> None:
    with pytest.raises(PolicyError) as exc:
        policy_from_wire({"windows": ["09:00-17:00", "mon-fry 19:00-08:00"]})
    assert exc.value.field == "windows[1]"
    with pytest.raises(PolicyError) as exc:
        policy_from_wire({"cpu_below": 150})
    assert exc.value.field == "idle.cpu_below"
