"""The launcher's parts that need no controller: backoff, secrets, signals, the exec wrapper."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent.agent import EXIT_CONFIG, EXIT_REFUSED
from racon import launcher, pdeathsig
from racon.launcher import AGENT_FINAL_EXITS, Child, GiveUp, RestartPolicy, Supervisor

from .harness import ROOT, alive, wait_for


def test_backoff_doubles_from_one_second_up_to_the_cap() -> None:
    policy = RestartPolicy(limit=100)
    delays = [policy.next_delay(started=t, now=t + 1) for t in range(0, 80, 10)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert policy.count == 8


def test_backoff_starts_over_after_a_stable_run() -> None:
    policy = RestartPolicy()
    policy.next_delay(started=0, now=1)
    policy.next_delay(started=2, now=3)
    assert policy.next_delay(started=10, now=10 + policy.stable_after) == 1.0


def test_a_crash_loop_is_given_up_after_the_limit_within_the_window() -> None:
    policy = RestartPolicy(limit=3, window=300)
    assert all(policy.next_delay(started=t, now=t) is not None for t in (0, 10, 20))
    assert policy.next_delay(started=30, now=30) is None


def test_restarts_older_than_the_window_no_longer_count() -> None:
    policy = RestartPolicy(limit=3, window=300)
    for t in (0, 10, 20):
        policy.next_delay(started=t, now=t)
    assert policy.next_delay(started=311, now=311) is not None


def test_agent_exits_that_a_restart_cannot_fix_match_the_agent() -> None:
    assert AGENT_FINAL_EXITS == {EXIT_CONFIG, EXIT_REFUSED}


@pytest.fixture
def no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    # ensure_secrets fills os.environ: give it a copy, so nothing it sets outlives the test.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for key in launcher.GENERATED:
        monkeypatch.delenv(key, raising=False)


def test_local_agents_share_the_cores_unless_a_policy_file_sets_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RACON_POLICY", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert launcher.local_agent_threads(1) == []  # one agent: every core, as the agent plans
    assert launcher.local_agent_threads(2) == ["--max-threads", "4"]
    assert launcher.local_agent_threads(3) == ["--max-threads", "2"]
    assert launcher.local_agent_threads(16) == ["--max-threads", "1"]  # never 0
    monkeypatch.setenv("RACON_POLICY", "/etc/racon/policy.toml")
    assert launcher.local_agent_threads(2) == []  # the operator's cap wins


@pytest.mark.usefixtures("no_secrets")
def test_secrets_are_generated_once_into_a_private_env_file(tmp_path: Path) -> None:
    env_file = tmp_path / "var" / ".env.local"
    created = launcher.ensure_secrets(env_file)
    assert created == list(launcher.GENERATED)
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    lines = env_file.read_text().splitlines()
    assert lines == [
        f"{k}={os.environ[k]}" for k in launcher.GENERATED
    ]  # plain KEY=VALUE, no quotes
    assert os.environ["AI_API_KEY"].startswith("rk_")
    first = {k: os.environ.pop(k) for k in launcher.GENERATED}
    assert launcher.ensure_secrets(env_file) == []
    assert {k: os.environ[k] for k in launcher.GENERATED} == first


@pytest.mark.usefixtures("no_secrets")
def test_a_variable_already_set_wins_over_the_env_file_and_other_lines_are_kept(
    tmp_path: Path,
) -> None:
    env_file = tmp_path / ".env.local"
    env_file.write_text("# mine\nSECRET_KEY=from-file\nEXTRA='quoted value'\n")
    os.environ["SECRET_KEY"] = "from-env"
    os.environ["AI_API_KEY"] = "rk_operator"
    created = launcher.ensure_secrets(env_file)
    assert "SECRET_KEY" not in created and "AI_API_KEY" not in created
    assert os.environ["SECRET_KEY"] == "from-env"
    assert os.environ["EXTRA"] == "quoted value"
    text = env_file.read_text()
    assert text.startswith("# mine\nSECRET_KEY=from-file\nEXTRA='quoted value'\n")
    assert "rk_operator" not in text and "RACON_REDIS_PASSWORD=" in text
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600


def test_a_crashing_child_is_restarted_with_a_logged_line_then_given_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sup = Supervisor()
    child = sup.start(
        Child(
            "crasher",
            [sys.executable, "-c", "raise SystemExit(7)"],
            policy=RestartPolicy(first=0.01, cap=0.02, limit=3),
        )
    )
    pids = set()
    try:
        with pytest.raises(GiveUp, match=r"crasher exited with 7 after 3 restarts within 300 s"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if child.proc is not None:
                    pids.add(child.proc.pid)
                sup.tick()
                time.sleep(0.02)
    finally:
        sup.stop()
    out = capsys.readouterr().out
    for n in (1, 2, 3):
        assert f"[racon] crasher exited with 7; restarting in 0.0 s (restart {n})" in out
    assert len(pids) == 4


def test_an_agent_refused_by_the_controller_is_left_stopped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sup = Supervisor()
    child = sup.start(
        Child(
            "node-agent x",
            [sys.executable, "-c", "raise SystemExit(3)"],
            final_exits=AGENT_FINAL_EXITS,
        )
    )
    assert child.proc is not None
    child.proc.wait(timeout=60)
    sup.tick()
    assert child.proc is None and child.restart_at is None
    assert "node-agent x exited with 3; not restarting it" in capsys.readouterr().out


def test_stop_kills_a_child_that_ignores_sigterm_after_its_grace(tmp_path: Path) -> None:
    marker = tmp_path / "ready"
    code = (
        "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(marker)!r}).touch(); time.sleep(600)"
    )
    sup = Supervisor()
    child = sup.start(Child("stubborn", [sys.executable, "-c", code], grace=0.5))
    try:
        wait_for(marker.exists, 60, "the child to ignore SIGTERM")
    finally:
        sup.stop()
    assert child.proc is not None and child.proc.returncode == -signal.SIGKILL


SIGNALLED = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a job started in the background by a script
from racon.launcher import Child, Shutdown, Supervisor
sup = Supervisor()
sup.install_signal_handlers()
sup.start(Child("sleeper", ["sleep", "600"]))
print("pid", sup.children[0].proc.pid, flush=True)
try:
    while True:
        sup.tick()
        time.sleep(0.1)
except Shutdown as exc:
    print("shutdown", exc.args[0], flush=True)
finally:
    sup.stop()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_stop_the_supervisor_and_its_children(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("pid "):
            line = proc.stdout.readline()
            assert line, "the supervisor exited early"
        sleeper = psutil.Process(int(line.split()[1]))
        wait_for(lambda: sleeper.cmdline() == ["sleep", "600"], 60, "the sleeper to start")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert f"shutdown {int(sig)}" in out
        assert "[racon] stopping sleeper" in out
        wait_for(lambda: not alive([sleeper]), 60, "the sleeper to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


PARENT = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from racon.pdeathsig import wrap
child = subprocess.Popen(wrap(["sleep", "600"]))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_wrapped_child_dies_when_its_parent_is_sigkilled() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-I", "-c", PARENT, str(ROOT)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        children.append(psutil.Process(int(parent.stdout.readline())))
        wait_for(lambda: children[0].cmdline() == ["sleep", "600"], 60, "the exec of sleep")
        parent.kill()
        parent.wait(timeout=30)
        wait_for(lambda: not alive(children), 60, "the child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for p in alive(children):
            p.kill()


def test_the_wrapper_does_not_run_a_command_whose_parent_is_already_gone() -> None:
    # PID 1 is never our parent: as if the launcher had died between fork and prctl.
    done = subprocess.run(
        [sys.executable, "-I", pdeathsig.__file__, "1", str(int(signal.SIGTERM)), "echo", "ran"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "ran" not in done.stdout


def test_psutil_sees_a_zombie_as_gone() -> None:
    # The end-to-end tests rely on alive(): a child reparented to init may linger as a zombie.
    p = psutil.Popen(["true"])
    wait_for(lambda: p.status() == psutil.STATUS_ZOMBIE, 30, "a zombie")
    assert alive([p]) == []
    p.wait()
