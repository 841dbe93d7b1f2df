"""Exec wrapper that ties a child's life to the launcher: `python racon/pdeathsig.py PPID SIG cmd...`.

PR_SET_PDEATHSIG survives execve, so the command gets SIG when the launcher dies, even by
SIGKILL. It is set here, after fork and before exec of the real command, and not in Popen's
preexec_fn, which is unsafe in a process with threads (agent/runtime/server.py does the same for
llama-server). The signal fires when the *thread* that forked exits: the launcher forks from its
main thread only, which lives as long as the launcher.

`wrap()` runs this file as a script with `-I` (no PYTHON* variables, no script directory on
sys.path: racon/ holds a logging.py), so the wrapper costs an interpreter start and no import of
the racon package (whose __init__ loads Celery).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def wrap(argv: list[str], *, sig: int = signal.SIGTERM) -> list[str]:
    """argv, started through this wrapper: it gets `sig` when the calling process dies."""
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), str(int(sig)), *argv]


def main(args: list[str]) -> int:
    if len(args) < 3:
        print("usage: pdeathsig.py PARENT_PID SIGNAL COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent, sig, argv = int(args[0]), int(args[1]), args[2:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig) != 0:
        print(
            f"warning: PR_SET_PDEATHSIG failed (errno {ctypes.get_errno()}); {argv[0]} will outlive a killed launcher",
            file=sys.stderr,
            flush=True,
        )
    # The parent may have died between fork and prctl: then no signal will ever come.
    if os.getppid() != parent:
        return 1
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"error: cannot run {argv[0]}: {exc}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
