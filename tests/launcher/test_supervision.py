"""The real launcher, killed at: its agent, its embedded Redis, itself (SIGTERM and SIGKILL)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from .harness import (
    READY_TIMEOUT,
    Launcher,
    alive,
    describe,
    is_agent,
    is_redis,
    start_launcher,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("launcher") / "var"


@pytest.fixture(scope="module")
def launcher(var: Path) -> Iterator[Launcher]:
    """One launcher for the module's tests (its start costs tens of seconds); the SIGTERM test
    stops it, so it comes after those that need it running."""
    la = start_launcher(var)
    try:
        la.wait_log(r"\[racon\] ready", READY_TIMEOUT)
        yield la
    finally:
        la.close()


def _redis_client(la: Launcher) -> redis.Redis:
    port = int(la.wait_log(r"embedded Redis on 127\.0\.0\.1:(\d+)", 10).group(1))
    password = la.secrets()["RACON_REDIS_PASSWORD"]
    return redis.Redis(
        host="127.0.0.1", port=port, password=password, decode_responses=True, socket_timeout=10
    )


def _node_users(r: redis.Redis) -> list[str]:
    try:
        return [
            line.split(" ")[1]
            for line in r.execute_command("ACL", "LIST")
            if line.split(" ")[1].startswith("node-")
        ]
    except redis.RedisError:
        return []


def test_a_killed_agent_is_restarted_while_the_controller_keeps_serving(launcher: Launcher) -> None:
    agent = wait_for(lambda: launcher.child(is_agent), 60, "the node-agent child")
    statuses: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            statuses.append(launcher.health())
            stop.wait(0.5)

    assert launcher.health() == 200
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        mark = len(launcher.log())
        agent.kill()
        launcher.wait_log(
            r"\[racon\] node-agent local-1 exited with -9; restarting in [\d.]+ s \(restart 1\)",
            60,
            after=mark,
        )
        again = wait_for(
            lambda: (p := launcher.child(is_agent)) is not None and p.pid != agent.pid and p,
            120,
            "a new node-agent",
        )
        assert again.is_running()
        time.sleep(2)  # the controller is probed on both sides of the restart
    finally:
        stop.set()
        prober.join(timeout=60)
    assert statuses, "the controller was never probed"
    assert all(s == 200 for s in statuses), statuses


def test_a_killed_embedded_redis_comes_back_on_its_port_with_the_node_users(
    launcher: Launcher,
) -> None:
    r = _redis_client(launcher)
    users = wait_for(lambda: _node_users(r), 120, "the local node's Redis user")
    time.sleep(10)  # the launcher notes ACL users every 2 s
    server = launcher.child(is_redis)
    assert server is not None, [describe(p) for p in launcher.descendants()]
    mark = len(launcher.log())
    server.kill()
    launcher.wait_log(r"\[racon\] embedded Redis exited with -9; restarting it", 60, after=mark)
    launcher.wait_log(
        r"\[racon\] embedded Redis is back on 127\.0\.0\.1:\d+ \(1 node users restored\)",
        60,
        after=mark,
    )
    new = wait_for(
        lambda: (p := launcher.child(is_redis)) is not None and p.pid != server.pid and p,
        60,
        "a new redis-server",
    )
    assert new.is_running()
    assert _node_users(r) == users  # same port, same password: the old client's URL still works
    # The agent reconnects with the credential it already holds: its user shows in CLIENT LIST.
    wait_for(
        lambda: any(c.get("user") == users[0] for c in r.client_list()),
        120,
        "the agent's reconnection",
    )
    wait_for(lambda: launcher.health() == 200, 120, "/health answering 200 again")


def test_sigterm_stops_the_launcher_and_every_child(launcher: Launcher) -> None:
    procs = launcher.descendants()
    assert any(is_agent(p.cmdline()) for p in procs)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=120) == 0
    assert "SIGTERM: shutting down" in launcher.log()
    wait_for(lambda: not alive(procs), 60, "every child to be gone")


def test_children_die_with_a_sigkilled_launcher(var: Path, launcher: Launcher) -> None:
    # After the shared launcher (same var dir: migrated, secrets made), so the two never overlap.
    assert launcher.proc.poll() is not None
    la = start_launcher(var)
    try:
        la.wait_log(r"\[racon\] ready", READY_TIMEOUT)
        wait_for(lambda: la.child(is_agent), 60, "the node-agent child")
        procs = la.descendants()
        assert any(is_redis(p.cmdline()) for p in procs), [describe(p) for p in procs]
        os.kill(la.proc.pid, signal.SIGKILL)
        la.proc.wait(timeout=30)
        try:
            wait_for(lambda: not alive(procs), 60, "every child to die with the launcher")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: still running {[describe(p) for p in alive(procs)]}"
            ) from None
    finally:
        la.close()
