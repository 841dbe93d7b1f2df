"""`make test-load`: the timing-sensitive tests (e2e, cluster, TUI, reliability) while a bounded
CPU burner takes one core, as on a contributor's busy laptop.

The burner is a separate process spinning on one core until the tests end (and never longer than
``--limit`` seconds). Its measured share of a core (its CPU time over the wall time it ran) is
printed at the end: under 0.9 the run did not load the machine as intended, and it fails.

On a small machine the tests' own processes (controllers, agents, llama-servers) want every core,
and at equal priority the kernel shares the burner's core with them: on 2 cores a run measured
0.59 of a core. Linux's autogroup scheduling shares the CPU between sessions first, and the test
harnesses start each process in a session of its own, so a plain nice did not help either (0.73
at nice -10). The burner therefore runs in a session of its own whose autogroup, and itself, are
at nice -10 where that is permitted (root, CAP_SYS_NICE). Where it is not, the tests run at nice
+10, which helps only without autogroup: the share printed tells whether the run was loaded.

Test paths among the pytest arguments (``make test-load PYTEST_ARGS=tests/e2e/test_pause.py``, or
``scripts/test-load.py -- tests/e2e/test_pause.py::test_x -x``) are run instead of the four areas.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection

AREAS = ["tests/e2e", "tests/cluster", "tests/tui", "tests/reliability"]
BURNER_NICE = -10  # the burner's priority over the tests (module docstring)


def _is_test_path(arg: str) -> bool:
    """A pytest argument that names a test file, directory or node id (not an option or its value)."""
    return not arg.startswith("-") and os.path.exists(arg.split("::", 1)[0])


def _burn(limit: float, ranked: Connection) -> None:
    """Spin for ``limit`` seconds; first outrank the tests (module docstring) and send whether
    that was permitted."""
    os.setsid()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BURNER_NICE)
        # A missing file (a kernel without autogroup) is fine: nice alone then ranks the burner.
        with contextlib.suppress(FileNotFoundError), open("/proc/self/autogroup", "w") as fh:
            fh.write(str(BURNER_NICE))
        ranked.send(True)
    except PermissionError:
        ranked.send(False)
    ranked.close()
    end = time.monotonic() + limit
    x = 0
    while time.monotonic() < end:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=4 * 3600, help="burner's time bound (s)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    burner = ctx.Process(target=_burn, args=(args.limit, theirs))
    burner.start()
    assert burner.pid is not None
    started = time.monotonic()
    try:
        named = any(_is_test_path(a) for a in args.pytest_args)
        cmd = [sys.executable, "-m", "pytest", *([] if named else AREAS), *args.pytest_args]
        if ours.poll(30) and ours.recv():
            rank = f"burner and its session at nice {BURNER_NICE}"
        else:
            cmd = ["nice", "-n", str(-BURNER_NICE), *cmd]
            rank = f"tests at nice {-BURNER_NICE} (not permitted to raise the burner)"
        print(
            f"[test-load] one core busy (burner pid {burner.pid}, {rank}); running: {' '.join(cmd)}"
        )
        rc = subprocess.call(cmd)
    finally:
        wall = time.monotonic() - started
        cpu = _cpu_seconds(burner.pid)
        burner.terminate()
        burner.join(10)
    share = cpu / wall if wall > 0 else 0.0
    print(f"[test-load] burner CPU share: {share:.2f} of a core over {wall:.0f} s (goal >= 0.90)")
    if share < 0.9:
        print("[test-load] the burner did not hold a core: this run does not count as loaded")
        return rc or 1
    return rc


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


if __name__ == "__main__":
    sys.exit(main())
