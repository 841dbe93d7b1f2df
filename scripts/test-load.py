"""`make test-load`: the timing-sensitive tests (e2e, cluster, TUI, reliability) while a bounded
CPU burner takes one core, as on a contributor's busy laptop.

The burner is a separate process spinning on one core until the tests end (and never longer than
``--limit`` seconds). Its measured share of a core (its CPU time over the wall time it ran) is
printed at the end: under 0.9 the run did not load the machine as intended, and it fails.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

AREAS = ["tests/e2e", "tests/cluster", "tests/tui", "tests/reliability"]


def _burn(limit: float) -> None:
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
    burner = multiprocessing.get_context("spawn").Process(target=_burn, args=(args.limit,))
    burner.start()
    assert burner.pid is not None
    started = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "pytest", *AREAS, *args.pytest_args]
        print(f"[test-load] one core busy (burner pid {burner.pid}); running: {' '.join(cmd)}")
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
