"""Start daphne as one or more processes accepting on one listening socket (pre-fork style).

daphne runs one event loop in one process. Binding the socket here and handing it to several
daphne processes with --fd lets the kernel spread connections across them, so the controller uses
more than one core without a separate load balancer.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def daphne_argv(fd: int, access_log: str | None = None) -> list[str]:
    """daphne on an inherited socket; without access_log, no per-request access line at all
    (thousands of heartbeats a second would otherwise each cost a formatted write)."""
    argv = [str(Path(sys.executable).parent / "daphne"), "--fd", str(fd)]
    argv += ["--access-log", access_log] if access_log else ["-v", "0"]
    return [*argv, "racon.asgi:application"]


def start_daphnes(
    sock: socket.socket,
    processes: int,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    access_log: str | None = None,
    **popen: Any,
) -> list[subprocess.Popen[bytes]]:
    """`processes` daphne processes sharing the listening socket (the caller keeps it open)."""
    if processes < 1:
        raise ValueError("processes must be at least 1")
    fd = sock.fileno()
    return [
        subprocess.Popen(
            daphne_argv(fd, access_log),
            cwd=cwd,
            env=env if env is not None else dict(os.environ),
            pass_fds=(fd,),
            **popen,
        )
        for _ in range(processes)
    ]
