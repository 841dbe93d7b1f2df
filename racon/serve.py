"""The controller's HTTP server layer: daphne, pre-forked, plain on loopback and TLS on the LAN.

daphne runs one event loop in one process. Binding the sockets here and handing them to several
daphne processes (`--fd`) lets the kernel spread connections across them, so the controller uses
more than one core without a separate load balancer. Each daphne process runs `racon-daphne`
(`python -m racon.daphne_tls`), daphne's own command line plus what daphne's endpoint strings
cannot say (docs/design/serving.md, "Server layer"):

- `--tls-fd N --tls-cert C --tls-key K`: HTTPS on an inherited listening socket. Twisted's `ssl:`
  endpoint binds its own port, which several processes cannot share; here the adopted socket's
  connections are wrapped in Twisted's TLS (TLSMemoryBIOFactory, pyOpenSSL), so `BIND=<LAN
  address> make run` serves HTTPS on the LAN from every daphne process while the plain `--fd`
  listener stays on loopback.
- Body limits per route, on by default (racon/settings.py HTTP_MAX_BODY_BYTES, 4 MiB; the KV
  route KV_TRANSFER_MAX_BYTES; the bundle upload HTTP_MAX_UPLOAD_BYTES, 1 GiB): a request whose
  Content-Length is larger gets 413 and the connection closes before its body is read (Twisted
  would otherwise buffer it whole before daphne calls the application); a chunked body is cut off
  at the limit the same way.
- RACON_HTTP_HEADER_TIMEOUT (30 s): a request's headers must be complete this long after its
  first byte (408, closed); RACON_HTTP_IDLE_TIMEOUT (120 s): a connection that sends nothing for
  this long is closed (Twisted's own default is 12 hours).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

SERVE_MODULE = "racon.daphne_tls"  # what runs in each daphne process


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def daphne_argv(
    fd: int | None,
    access_log: str | None = None,
    *,
    tls_fd: int | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> list[str]:
    """daphne on inherited sockets: `fd` plain, `tls_fd` HTTPS with tls_cert/tls_key. Without
    access_log, no per-request access line at all (thousands of heartbeats a second would
    otherwise each cost a formatted write)."""
    # Every daphne process runs this module: the server layer's limits hold on loopback too.
    # The console script (named racon-daphne, so a process list shows daphne) where installed.
    script = Path(sys.executable).parent / "racon-daphne"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", SERVE_MODULE]
    if fd is not None:
        argv += ["--fd", str(fd)]
    if tls_fd is not None:
        if tls_cert is None or tls_key is None:
            raise ValueError("tls_fd needs tls_cert and tls_key")
        argv += ["--tls-fd", str(tls_fd), "--tls-cert", str(tls_cert), "--tls-key", str(tls_key)]
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
