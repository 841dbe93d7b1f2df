"""`make run`: start the whole system in the foreground and keep it running; Ctrl-C or SIGTERM
stops every process it started.

Order: secrets (generated once into var/.env.local), embedded Redis when REDIS_URL is unset,
migrations, bootstrap (admin user, enrollment token, default model), daphne, Celery worker, the
placement worker (its own queue) and beat, local node agent(s), then a deployment of the default
model.

Supervision: a child that exits is started again after a backoff (1 s doubling to 30 s, reset
once it has run for a minute), and the embedded Redis likewise, on its port, with its password,
data and ACL users. A child that crash-loops (10 restarts within 5 minutes) stops everything with
exit status 1. Every child gets a signal when the launcher dies, even by SIGKILL
(racon/pdeathsig.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from dotenv import dotenv_values, set_key

from racon import tls
from racon.embedded import EmbeddedRedis, install_tls_redis, start_lan_redis, start_redis
from racon.lan import BindError, redis_url_problem, resolve_bind
from racon.pdeathsig import wrap
from racon.redis_acl import redis_memory_warning
from racon.serve import bind_listener, daphne_argv

ROOT = Path(__file__).resolve().parent.parent
GENERATED = (
    "SECRET_KEY",
    "NODE_ENROLLMENT_SECRET",
    "AI_API_KEY",
    "RACON_ADMIN_PASSWORD",
    "RACON_REDIS_PASSWORD",
)
# node-agent's EXIT_CONFIG and EXIT_REFUSED (agent/agent.py): a bad configuration, a refused
# token or a revoked node. Starting it again cannot help, and the rest of the system is fine.
AGENT_FINAL_EXITS = frozenset({2, 3})
TICK_SECONDS = 0.5
ACL_SNAPSHOT_SECONDS = 2.0


def load_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (python-dotenv's syntax); a key without a value counts as unset."""
    return {k: v for k, v in dotenv_values(path, interpolate=False).items() if v is not None}


def ensure_secrets(env_file: Path) -> list[str]:
    """Fill missing secrets from the env file, generating (and storing) the ones never made.
    Variables already in the environment win over the file; the file is mode 0600."""
    stored = load_env_file(env_file)
    created: list[str] = []
    for key in GENERATED:
        if os.environ.get(key):
            continue
        if key in stored:
            os.environ[key] = stored[key]
            continue
        os.environ[key] = ("rk_" if key == "AI_API_KEY" else "") + secrets.token_urlsafe(
            24 if key == "RACON_ADMIN_PASSWORD" else 40
        )
        created.append(key)
    for key, value in stored.items():
        os.environ.setdefault(key, value)
    if created:
        env_file.parent.mkdir(parents=True, exist_ok=True)
        # Made 0600 before the first secret is written into it; set_key keeps the other lines.
        os.close(os.open(env_file, os.O_WRONLY | os.O_CREAT, 0o600))
        for key in created:
            set_key(env_file, key, os.environ[key], quote_mode="never")
        env_file.chmod(0o600)
    return created


class Shutdown(BaseException):  # like KeyboardInterrupt, never caught by `except Exception`
    """SIGINT or SIGTERM reached the launcher."""


class GiveUp(Exception):
    """A child crash-loops, or the embedded Redis cannot be brought back: stop everything."""


@dataclass
class RestartPolicy:
    """Exponential backoff between restarts, and the crash-loop limit. Pure: time is passed in."""

    first: float = 1.0
    cap: float = 30.0
    stable_after: float = 60.0  # a child that ran this long starts over at `first`
    limit: int = 10  # restarts allowed within `window` seconds
    window: float = 300.0
    count: int = 0  # restarts so far
    delay: float = 0.0
    recent: deque[float] = field(default_factory=deque)

    def next_delay(self, *, started: float, now: float) -> float | None:
        """Seconds to wait before starting again a child that started at `started` and is gone at
        `now`; None when it has already been restarted `limit` times within `window`."""
        while self.recent and now - self.recent[0] > self.window:
            self.recent.popleft()
        if len(self.recent) >= self.limit:
            return None
        if now - started >= self.stable_after:
            self.delay = 0.0
        self.delay = self.first if self.delay <= 0 else min(self.cap, self.delay * 2)
        self.recent.append(now)
        self.count += 1
        return self.delay


@dataclass
class Child:
    name: str
    argv: list[str]
    grace: float = 10.0  # SIGTERM, then SIGKILL of its process group after this long
    # What it gets when the launcher dies; nobody is left to send a SIGKILL after a grace period.
    pdeathsig: int = signal.SIGTERM
    pass_fds: tuple[int, ...] = ()
    env: dict[str, str] | None = None  # None: the launcher's own environment
    final_exits: frozenset[int] = frozenset()
    stops_first: bool = False  # agents drain while the controller can still hear them
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)


def kill_group(pid: int) -> None:
    """SIGKILL what is left of a child's process group (start_new_session made it its leader)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.redis: EmbeddedRedis | None = None
        self.redis_policy = RestartPolicy(first=0.5, cap=10.0)
        self.redis_started = time.monotonic()
        self.redis_restart_at: float | None = None
        self.acl_seen = 0.0
        self.signalled: int | None = None
        self.hurry = False
        self.critical = False

    # --- signals -------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        # Explicit for both: a launcher started in the background by a script inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt (FACTS.md, Processes).
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is not None:
            self.hurry = True  # a second one: kill what is left without waiting
            return
        self.signalled = signum
        # Never between Popen returning and the child being recorded: it would be left behind.
        if not self.critical:
            raise Shutdown(signum)

    @contextmanager
    def uninterrupted(self) -> Iterator[None]:
        """SIGINT and SIGTERM wait for the block's end: a child must never be left started and
        unrecorded (between Popen returning and the assignment)."""
        self.critical = True
        try:
            yield
        finally:
            self.critical = False
        self.raise_if_signalled()

    def raise_if_signalled(self) -> None:
        if self.signalled is not None:
            raise Shutdown(self.signalled)

    # --- children ------------------------------------------------------------------------------

    def start(self, child: Child) -> Child:
        self.children.append(child)
        print(f"[racon] starting {child.name}: {' '.join(child.argv[:4])} ...", flush=True)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        with self.uninterrupted():
            child.proc = subprocess.Popen(
                wrap(child.argv, sig=child.pdeathsig),
                cwd=ROOT,
                start_new_session=True,
                pass_fds=child.pass_fds,
                env=child.env,
            )
            child.started = time.monotonic()

    def tick(self) -> None:
        """Notice exits and restart what is due. Raises GiveUp on a crash loop."""
        self.raise_if_signalled()  # one that came during a block that then failed
        now = time.monotonic()
        self._tick_redis(now)
        for child in self.children:
            self._tick_child(child, now)

    def _tick_child(self, child: Child, now: float) -> None:
        if child.proc is not None:
            code = child.proc.poll()
            if code is None:
                return
            # A child killed with -9 leaves its own children (Celery's pool) in its group.
            kill_group(child.proc.pid)
            child.proc = None
            if code in child.final_exits:
                print(
                    f"[racon] {child.name} exited with {code}; not restarting it "
                    "(a configuration error, a refused token or a revoked node: see its log)",
                    flush=True,
                )
                return
            delay = child.policy.next_delay(started=child.started, now=now)
            if delay is None:
                p = child.policy
                raise GiveUp(
                    f"{child.name} exited with {code} after {p.limit} restarts within {p.window:.0f} s; giving up"
                )
            child.restart_at = now + delay
            print(
                f"[racon] {child.name} exited with {code}; restarting in {delay:.1f} s (restart {child.policy.count})",
                flush=True,
            )
        elif child.restart_at is not None and now >= child.restart_at:
            child.restart_at = None
            print(f"[racon] restarting {child.name}", flush=True)
            self._spawn(child)

    def _tick_redis(self, now: float) -> None:
        redis = self.redis
        if redis is None:
            return
        if self.redis_restart_at is None:
            if redis.alive():
                if now - self.acl_seen >= ACL_SNAPSHOT_SECONDS:
                    redis.remember_users()
                    self.acl_seen = now
                return
            self._schedule_redis(
                now, f"exited with {redis.process.returncode}", started=self.redis_started
            )
            return
        if now < self.redis_restart_at:
            return
        try:
            with self.uninterrupted():  # bounded: restart() waits at most 10 s
                redis.restart()
        except RuntimeError as exc:
            self._schedule_redis(now, f"did not come back ({exc})", started=now)
            return
        self.redis_restart_at = None
        self.redis_started = time.monotonic()
        print(
            f"[racon] embedded Redis is back on {redis.address}:{redis.port} ({len(redis.users)} node users restored)",
            flush=True,
        )

    def _schedule_redis(self, now: float, what: str, *, started: float) -> None:
        delay = self.redis_policy.next_delay(started=started, now=now)
        if delay is None:
            raise GiveUp(
                f"the embedded Redis {what}, {self.redis_policy.limit} restarts "
                f"within {self.redis_policy.window:.0f} s; giving up"
            )
        self.redis_restart_at = now + delay
        print(
            f"[racon] embedded Redis {what}; "
            f"restarting it on port {self.redis.port if self.redis else '?'} "
            f"in {delay:.1f} s (restart {self.redis_policy.count})",
            flush=True,
        )

    # --- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        # SIGTERM to each main process: an agent drains (and reports) while the controller is
        # still up, then stops its own llama.cpp children; Celery stops its pool. Whatever is left
        # of a process group after its grace period is killed.
        self.signalled = self.signalled or signal.SIGTERM  # from now on a signal means hurry
        self._terminate([c for c in self.children if c.stops_first])
        self._terminate([c for c in self.children if not c.stops_first])
        if self.redis is not None:
            print("[racon] stopping embedded Redis", flush=True)
            self.redis.stop()

    def _terminate(self, children: list[Child]) -> None:
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            assert child.proc is not None
            print(f"[racon] stopping {child.name}", flush=True)
            child.proc.send_signal(signal.SIGTERM)
        deadline = {c.name: time.monotonic() + c.grace for c in running}
        while not self.hurry and any(
            c.proc is not None and c.proc.poll() is None and time.monotonic() < deadline[c.name]
            for c in running
        ):
            time.sleep(0.1)
        for child in children:
            if child.proc is not None:
                if child.proc.poll() is None:
                    print(f"[racon] {child.name} did not stop in time; killing it", flush=True)
                kill_group(child.proc.pid)
                child.proc.wait()


def local_agent_threads(agents: int) -> list[str]:
    """node-agent flags that share this machine's cores among its `agents` local agents.

    Each agent would otherwise plan its engine for every core, and two engines with a thread per
    core on the same cores stall each other: ggml's threads meet at a barrier after each step, so
    an engine whose second thread is waiting for a core loses a time slice per step. Found by the
    reliability suite: with both replicas busy, a second's CPU taken by a restarting process left
    both at about half a token per second for the next minute. An operator's lending policy file
    (RACON_POLICY) sets its own cap, and wins.
    """
    if agents <= 1 or os.environ.get("RACON_POLICY"):
        return []
    return ["--max-threads", str(max(1, (os.cpu_count() or 1) // agents))]


def wait_health(url: str, sup: Supervisor, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.tick()
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(TICK_SECONDS)
    raise SystemExit(f"error: the controller at {url} did not become healthy within {timeout:.0f}s")


def env_defaults(url: str) -> None:
    """The environment `make run` gives its processes unless the operator set it."""
    os.environ.setdefault("RACON_CONTROLLER_URL", url)
    # A controller that others' machines join is never in debug mode unless asked (DEBUG=true):
    # debug pages show settings and tracebacks to anyone.
    os.environ.setdefault("DEBUG", "false")
    os.environ.setdefault("LOG_FORMAT", "text")
    # The first run reads as the launcher's own lines and its one ready summary: the processes it
    # starts log warnings and errors unless the operator asks for more (LOG_LEVEL=INFO make run
    # shows every event as it happens; the events are kept either way: /api/admin/events, the UI).
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ.setdefault("RACON_LOG_LEVEL", os.environ["LOG_LEVEL"])  # the local agents'
    # Named here, not left to settings' defaults, because the placement worker is started with
    # its queue's name (-Q) and settings must route to that same queue.
    os.environ.setdefault("CELERY_TASK_DEFAULT_QUEUE", "racon")
    os.environ.setdefault(
        "CELERY_PLACEMENT_QUEUE", f"{os.environ['CELERY_TASK_DEFAULT_QUEUE']}.placement"
    )


@dataclass
class Lan:
    """`BIND=<address> make run`: the LAN side of this controller."""

    address: str
    url: str  # the public URL: https://<address>:<port> (http:// with RACON_INSECURE_LAN=1)
    server: Any = None  # racon.tls.ServerCert; None with RACON_INSECURE_LAN=1
    insecure: bool = False


def lan_setup(address: str, port: int, var: Path, *, insecure: bool) -> Lan:
    """The CA and server certificate (racon/tls.py), and the environment every process of a LAN
    controller gets: the public URL, the join pin, the CA, the allowed hosts."""
    host = f"[{address}]" if ":" in address else address
    hosts = [
        h for h in (os.environ.get("ALLOWED_HOSTS") or "localhost,127.0.0.1,[::1]").split(",") if h
    ]
    if host not in hosts:
        hosts.append(host)
    os.environ["ALLOWED_HOSTS"] = ",".join(hosts)
    if insecure:
        print(
            "[racon] RACON_INSECURE_LAN=1: plain HTTP and a plaintext Redis on the LAN; anyone "
            "on it can read prompts and take over nodes. Unset it to get HTTPS and TLS",
            flush=True,
        )
        return Lan(address=address, url=f"http://{host}:{port}", insecure=True)
    ca, said = tls.ca_load_or_create(var_dir=var)
    if said:
        print(f"[racon] {said}", flush=True)
    explicit = os.environ.get("RACON_CONTROLLER_URL", "")
    name = httpx.URL(explicit).host if explicit else ""
    dns = ["localhost"] + ([name] if name and not _is_ip(name) else [])
    server, said = tls.server_cert_ensure(var_dir=var, ca=ca, ips=[address, "127.0.0.1"], dns=dns)
    if said:
        print(f"[racon] {said}", flush=True)
    os.environ["RACON_TLS_PIN"] = server.pin
    os.environ["RACON_TLS_CA_FILE"] = str(server.ca_path)
    # daphne terminates TLS itself: no proxy's X-Forwarded-Proto is to be believed.
    os.environ.setdefault("BEHIND_PROXY", "false")
    return Lan(address=address, url=f"https://{host}:{port}", server=server)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def lan_redis(lan: Lan, var: Path, *, insecure: bool) -> EmbeddedRedis:
    """The Redis nodes reach: Debian's redis-server (installed when missing) with TLS on the LAN
    address and loopback, `default` user off, the controller's own user, a user per node."""
    binary = install_tls_redis(lambda line: print(f"[racon] {line}", flush=True))
    server = lan.server
    redis = start_lan_redis(
        data_dir=var / "redis",
        address=lan.address,
        ca_file=server.ca_path if server else None,
        cert_file=server.cert_path if server else None,
        key_file=server.key_path if server else None,
        password=os.environ["RACON_REDIS_PASSWORD"],
        binary=binary,
        tls=not insecure,
        die_with_parent=True,
    )
    print(
        f"[racon] LAN Redis on {lan.address}:{redis.port} ({'plaintext' if insecure else 'TLS only'}; "
        f"{binary}): user `default` off, the controller's own user, one ACL user per node "
        "(password in var/.env.local)",
        flush=True,
    )
    return redis


def vllm_model_dir() -> Path | None:
    """With RACON_ENGINES naming vllm (issue 30): the vLLM engine venv and the default model's
    safetensors directory (scripts/install-vllm.sh: converted once, cached), else None."""
    engines = [e.strip() for e in os.environ.get("RACON_ENGINES", "").split(",")]
    if "vllm" not in engines:
        return None
    print("[racon] RACON_ENGINES names vllm: the engine venv and the model directory", flush=True)
    script = ROOT / "scripts" / "install-vllm.sh"
    subprocess.run([str(script)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run(
        [str(script), "--model"], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


# What a local agent must not inherit: it is a node like any other, and a node is untrusted.
CONTROLLER_ONLY = (
    "SECRET_KEY", "NODE_ENROLLMENT_SECRET", "AI_API_KEY", "RACON_ADMIN_PASSWORD",
    "RACON_REDIS_PASSWORD", "REDIS_URL", "CELERY_BROKER_URL", "DATABASE_URL",
    "RACON_AGENT_REDIS_URL", "METRICS_TOKEN",
)  # fmt: skip


def local_agent_env(token: str, lan: Lan | None) -> dict[str, str]:
    """A local agent's environment: the enrollment token (never argv), the controller's CA on a
    LAN, and none of the controller's secrets."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLER_ONLY}
    env["RACON_ENROLLMENT_TOKEN"] = token
    if lan is not None and lan.server is not None:
        env["RACON_CA_FILE"] = str(lan.server.ca_path)
    return env


def print_summary(url: str, lan: Lan | None, problem: str | None) -> None:
    """The one summary: ready (and where), or what is wrong; on a LAN, how to add a machine."""
    if problem:
        print(f"\n[racon] up, but NOT ready: {problem}", flush=True)
    else:
        print(
            f"\n[racon] ready: {url}  (web UI: log in as admin; API key: AI_API_KEY in var/.env.local)",
            flush=True,
        )
    if lan is None:
        return
    if lan.server is not None:
        print(
            f"[racon] LAN: {lan.url}  (HTTPS with this controller's own CA, {lan.server.ca_path}; "
            f"key pin {lan.server.pin})",
            flush=True,
        )
    else:
        print(f"[racon] LAN: {lan.url}  (plain HTTP: RACON_INSECURE_LAN=1)", flush=True)
    print(
        "[racon] add a machine: `.venv/bin/racon tokens create <its name>` (or the web UI's Tokens "
        "page) prints one line; run that line on the machine",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="racon-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--agents",
        type=int,
        default=int(os.environ.get("RACON_LOCAL_AGENTS", "1")),
        help="local node agents to start (0 for none)",
    )
    parser.add_argument("--no-deploy", action="store_true", help="do not deploy the default model")
    parser.add_argument(
        "--no-model", action="store_true", help="register no default model (implies --no-deploy)"
    )
    parser.add_argument(
        "--bind",
        default=os.environ.get("BIND", "127.0.0.1"),
        help="the LAN address to serve (HTTPS, TLS Redis); 0.0.0.0 picks this machine's private "
        "address; default 127.0.0.1: this machine only",
    )
    args = parser.parse_args(argv)
    if args.agents < 0:
        parser.error("--agents must be 0 or more")

    var = Path(os.environ.get("RACON_VAR_DIR", ROOT / "var"))
    var.mkdir(parents=True, exist_ok=True)
    created = ensure_secrets(var / ".env.local")
    port = int(os.environ.get("PORT", "8000"))
    rpc_port = int(os.environ.get("RACON_RPC_PORT", "50052"))
    try:
        lan_address, said = resolve_bind(args.bind)
    except BindError as exc:
        print(f"[racon] error: {exc}", file=sys.stderr, flush=True)
        return 2
    insecure = os.environ.get("RACON_INSECURE_LAN", "").lower() in ("1", "true", "yes")
    lan: Lan | None = None
    if lan_address:
        print(f"[racon] {said}", flush=True)
        lan = lan_setup(lan_address, port, var, insecure=insecure)
    # The launcher's own calls (health, the default deployment) go to loopback, which always
    # serves plain HTTP; the public URL (nodes, join lines) is the LAN's.
    url = f"http://127.0.0.1:{port}" if lan is None or not insecure else lan.url
    env_defaults(lan.url if lan is not None else url)
    py = sys.executable
    bindir = Path(py).parent
    sup = Supervisor()
    sup.install_signal_handlers()
    try:
        if lan is not None and not os.environ.get("REDIS_URL"):
            with sup.uninterrupted():
                sup.redis = lan_redis(lan, var, insecure=insecure)
            sup.redis_started = time.monotonic()
            os.environ["REDIS_URL"] = sup.redis.url
            os.environ.setdefault("RACON_AGENT_REDIS_URL", sup.redis.agent_url)
        elif lan is not None:
            problems = [
                problem
                for name in ("REDIS_URL", "RACON_AGENT_REDIS_URL")
                if (value := os.environ.get(name))
                and (problem := redis_url_problem(value, name=name))
            ]
            if problems:
                for problem in problems:
                    print(f"[racon] error: {problem}", file=sys.stderr, flush=True)
                return 2
        if not os.environ.get("REDIS_URL"):
            # The controller's user needs the password; each node gets a user of its own at
            # enrollment that reaches only its keys (racon/redis_acl.py). Appendonly keeps the
            # queues across a restart of this Redis (Supervisor._tick_redis).
            with sup.uninterrupted():
                sup.redis = start_redis(
                    data_dir=var / "redis",
                    password=os.environ["RACON_REDIS_PASSWORD"],
                    appendonly=True,
                    die_with_parent=True,
                )
            sup.redis_started = time.monotonic()
            os.environ["REDIS_URL"] = sup.redis.url
            print(
                f"[racon] embedded Redis on 127.0.0.1:{sup.redis.port} (password in var/.env.local)",
                flush=True,
            )
        elif warning := redis_memory_warning(os.environ["REDIS_URL"]):
            print(f"[racon] warning: {warning}", file=sys.stderr, flush=True)  # read, never changed
        subprocess.run([py, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, check=True)
        boot_args = [
            "--agents",
            str(max(1, args.agents)),
            *(["--no-model"] if args.no_model else []),
        ]
        vllm_dir = vllm_model_dir() if not args.no_model else None
        if vllm_dir is not None:
            boot_args += ["--model-dir", str(vllm_dir)]
        boot = subprocess.run(
            [py, "manage.py", "racon_bootstrap", *boot_args],
            cwd=ROOT,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        info = json.loads(boot.stdout.strip().splitlines()[-1])
        if created:
            print("\n[racon] generated secrets (stored in var/.env.local, shown once):", flush=True)
            for key in created:
                print(f"  {key}={os.environ[key]}", flush=True)
            print("", flush=True)
        processes = int(os.environ.get("DAPHNE_PROCESSES") or min(2, os.cpu_count() or 1))
        access_log = os.environ.get("RACON_ACCESS_LOG") or None
        # Several daphne processes accept on one socket (racon/serve.py); on this project's 2-core
        # machines two sustain 1.4-1.7x the heartbeats of one (bench/heartbeats.py, side by side).
        # The launcher keeps the socket open, so a restarted daphne accepts on it at once.
        if lan is not None and insecure:
            listener, tls_listener = bind_listener(lan.address, port), None
        else:
            listener = bind_listener("127.0.0.1" if lan is not None else args.bind, port)
            tls_listener = bind_listener(lan.address, port) if lan is not None else None
        fds = (listener.fileno(),) + ((tls_listener.fileno(),) if tls_listener else ())
        for i in range(max(1, processes)):
            name = "daphne" if processes <= 1 else f"daphne-{i + 1}"
            tls_args: dict[str, Any] = {}
            if tls_listener is not None and lan is not None and lan.server is not None:
                tls_args = {
                    "tls_fd": tls_listener.fileno(),
                    "tls_cert": lan.server.cert_path,
                    "tls_key": lan.server.key_path,
                }
            sup.start(
                Child(name, daphne_argv(listener.fileno(), access_log, **tls_args), pass_fds=fds)
            )
        celery = str(bindir / "celery")
        # Celery warns at length when run as root (containers, CI); the launcher's user is the
        # operator's choice, so keep the first run's output to the summary.
        os.environ.setdefault(
            "PYTHONWARNINGS", "ignore:You're running the worker with superuser privileges"
        )
        # SIGKILL: a worker orphaned by a killed launcher must not wait on its tasks (a placement
        # may block for minutes) or on its Redis, which dies too; even a cold shutdown (SIGQUIT)
        # hung for over a minute on a loaded machine. Its pool processes set PR_SET_PDEATHSIG
        # SIGKILL themselves (celery/concurrency/prefork.py), and acks_late tasks are redelivered.
        sup.start(
            Child(
                "celery-worker",
                [
                    celery,
                    "-A",
                    "racon",
                    "--quiet",  # no banner: the launcher prints one ready summary
                    "worker",
                    "-l",
                    "warning",
                    "--concurrency",
                    "4",
                    "-n",
                    "racon@%h",
                    "-Q",
                    os.environ["CELERY_TASK_DEFAULT_QUEUE"],
                ],
                pdeathsig=signal.SIGKILL,
            )
        )
        # Placements and speed challenges wait on agents (BLPOP, for minutes): their own worker
        # and queue (settings.CELERY_TASK_ROUTES), so the default worker above always has room
        # for beat's periodic tasks (health sweep, settlement). Time limits: settings.
        sup.start(
            Child(
                "celery-placement",
                [
                    celery,
                    "-A",
                    "racon",
                    "--quiet",  # no banner: the launcher prints one ready summary
                    "worker",
                    "-l",
                    "warning",
                    "--concurrency",
                    os.environ.get("RACON_PLACEMENT_CONCURRENCY") or "4",
                    "-n",
                    "placement@%h",
                    "-Q",
                    os.environ["CELERY_PLACEMENT_QUEUE"],
                ],
                pdeathsig=signal.SIGKILL,
            )
        )
        sup.start(
            Child(
                "celery-beat",
                [
                    celery,
                    "-A",
                    "racon",
                    "--quiet",  # no banner: the launcher prints one ready summary
                    "beat",
                    "-l",
                    "warning",
                    "-s",
                    str(var / "celerybeat-schedule"),
                ],
            )
        )
        wait_health(url, sup)
        models_dir = Path(os.environ.get("RACON_MODELS_DIR", var / "agent-models"))
        if vllm_dir is not None:  # the local agents offer the directory (a link to the cache)
            models_dir.mkdir(parents=True, exist_ok=True)
            link = models_dir / vllm_dir.name
            if not link.exists():
                link.symlink_to(vllm_dir)
        agent_env = local_agent_env(info["token"], lan)
        for i in range(args.agents):
            name = f"local-{i + 1}"
            # A LAN controller's own node is a member of the LAN pool like any joined machine:
            # it reaches the controller at the public URL (with the CA) and advertises the LAN
            # address, which the other machines' primaries can reach. The token travels in the
            # environment, never in argv (ps shows argv to every local user).
            agent_argv = [
                str(bindir / "node-agent"), "--foreground",
                "--controller-url", os.environ["RACON_CONTROLLER_URL"], "--node-name", name,
                "--state-dir", str(var / "agents" / name), "--models-dir", str(models_dir),
                "--advertise-address", lan.address if lan is not None else "127.0.0.1",
                "--rpc-port", str(rpc_port + i),
                *local_agent_threads(args.agents),
            ]  # fmt: skip
            # A restarted agent presents its stored credential, so the token's use count is not spent again.
            sup.start(
                Child(
                    f"node-agent {name}",
                    agent_argv,
                    env=agent_env,
                    grace=20.0,
                    final_exits=AGENT_FINAL_EXITS,
                    stops_first=True,
                )
            )
        problem = None
        if args.agents and info.get("model") and not (args.no_deploy or args.no_model):
            problem = deploy_default(url, info["model"], sup)
        print_summary(url, lan, problem)
        level = os.environ["LOG_LEVEL"].upper()
        if level not in ("DEBUG", "INFO"):
            print(
                f"[racon] logs: {level} and above only; LOG_LEVEL=INFO make run shows every event",
                flush=True,
            )
        print(f"[racon] try: curl {url}/v1/chat/completions -H 'Authorization: Bearer $AI_API_KEY' "
              "-H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{info.get('model')}\", "
              f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'", flush=True)  # fmt: skip
        while True:
            sup.tick()
            time.sleep(TICK_SECONDS)
    except Shutdown as exc:
        print(f"\n[racon] {signal.Signals(exc.args[0]).name}: shutting down", flush=True)
        return 0
    except GiveUp as exc:
        print(f"[racon] {exc}; stopping everything", flush=True)
        return 1
    finally:
        sup.stop()


def deploy_default(url: str, model: str, sup: Supervisor) -> str | None:
    """Wait for a READY local node, then deploy the default model (placement runs in Celery).
    Returns what is wrong when the system is not ready, else None."""
    headers = {"Authorization": f"Bearer {os.environ['AI_API_KEY']}"}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        sup.tick()
        try:
            nodes = httpx.get(
                f"{url}/api/admin/nodes?state=READY", headers=headers, timeout=5
            ).json()
            if nodes:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    else:
        print("[racon] no node became READY within 180 s; not deploying", flush=True)
        return "no node became READY within 180 s (" + nodes_said(url, headers) + ")"
    active = httpx.get(
        f"{url}/api/admin/deployments?model={model}", headers=headers, timeout=10
    ).json()
    if any(d["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED") for d in active):
        print(f"[racon] {model} is already deployed", flush=True)
        return None
    # A first request may have deployed it meanwhile (deployment_ensure); the scheduler then
    # refuses a second replica on the same node, which is no failure of make run.
    resp = httpx.post(
        f"{url}/api/admin/deployments", headers=headers, json={"model": model}, timeout=30
    )
    if resp.status_code >= 400:
        active = httpx.get(
            f"{url}/api/admin/deployments?model={model}", headers=headers, timeout=10
        ).json()
        if any(d["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED") for d in active):
            print(f"[racon] {model} is already deployed", flush=True)
            return None
        return f"could not deploy {model}: {resp.text[:500]}"
    print(f"[racon] deploying {model} (deployment {resp.json()['id']})", flush=True)
    return None


def nodes_said(url: str, headers: dict[str, str]) -> str:
    """The nodes' states in one phrase, and where to look next."""
    try:
        rows = httpx.get(f"{url}/api/admin/nodes", headers=headers, timeout=5).json()
        rows = rows.get("results", rows) if isinstance(rows, dict) else rows
        states = ", ".join(f"{n['name']} is {n['state']}" for n in rows) or "no node enrolled"
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        states = "the node list could not be read"
    return f"{states}; the agents' own lines: LOG_LEVEL=INFO make run"


if __name__ == "__main__":
    sys.exit(main())
