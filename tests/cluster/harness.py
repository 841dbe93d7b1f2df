"""Several hosts on one machine: network namespaces, per-link delay and rate, a real controller.

Each host is a network namespace `racon-<id>-hN` with one TUN device whose packets the wire
(tests/cluster/netwire.py) carries, with the host's link delay and rate, to the other hosts and
to the root namespace, where the controller (daphne + a Celery worker that also consumes the
placement queue), its own SQLite database and a private Redis listen on the root side's
address. The rate is also enforced by the kernel (tc tbf on the host's egress). Every host runs
a real `node-agent` inside its namespace (`ip netns exec`), advertising its own address.

Addresses: 10.213.X.0/24, X picked free per cluster; the root side is 10.213.X.1, host N is
10.213.X.(10+N). Ports: 19100-19199 in the root namespace; each namespace has its own ports.
Everything is removed on exit, after a failure too; namespaces left by a killed run (their owner
pid gone) are deleted when the next cluster starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from agent.hardware.benchmark import measure_claim_gflops, measure_mem_bandwidth
from racon.embedded import redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFIX = "racon-"
# Every prefix a test gives its clusters (test_gpu_split.py: "gp-racon-"): a killed run's
# namespaces are swept whatever their prefix, by their owner file (the cluster id's).
STALE_PREFIXES = ("racon-", "gp-racon-")
NS_RE = re.compile("^(?:" + "|".join(map(re.escape, STALE_PREFIXES)) + r")([0-9a-f]{8})-h\d+$")
OWNERS = Path("/run/racon-cluster")
PORTS = range(19100, 19200)
RPC_PORT = 19150  # inside each namespace
OPERATOR_KEY = "cluster-operator-key"
FAST_DELAY_MS = 0.5  # a LAN: 1 ms round trip between two fast hosts


def skip_reason() -> str | None:
    """Why the namespace cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, TUN devices, tc); CI runs as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the namespace cluster needs iproute2 (`ip` and `tc`)"
    if not Path("/dev/net/tun").exists():
        return "the namespace cluster needs /dev/net/tun"
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces with one of our prefixes whose owning test process is gone (a live
    run's, whose owner file names a live pid, are left alone)."""
    removed = []
    out = sh("ip", "netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = NS_RE.match(name)
        if not m:
            continue
        owner = OWNERS / f"{m.group(1)}.pid"
        try:
            alive = _pid_alive(int(owner.read_text()))
        except (OSError, ValueError):
            alive = False
        if not alive:
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
            owner.unlink(missing_ok=True)
    return removed


def _free_subnet() -> int:
    used = set(re.findall(r"10\.213\.(\d+)\.", sh("ip", "-4", "addr").stdout))
    used |= set(re.findall(r"10\.213\.(\d+)\.", sh("ip", "-4", "route").stdout))
    for x in range(1, 250):
        if str(x) not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/24 subnet")


def free_root_port(host: str, taken: set[int], *, also: tuple[str, ...] = ()) -> int:
    """A port of PORTS free on host and on every address in also (e.g. 127.0.0.1)."""
    for port in PORTS:
        if port in taken:
            continue
        free = True
        for addr in (host, *also):
            with socket.socket() as s:
                try:
                    s.bind((addr, port))
                except OSError:
                    free = False
                    break
        if not free:
            continue
        taken.add(port)
        return port
    raise RuntimeError("no free port in 19100-19199")


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


@dataclass
class LinkSpec:
    delay_ms: float = FAST_DELAY_MS
    rate_mbit: float = 0.0  # 0: unlimited (the wire's own speed, several hundred Mbit/s)


@dataclass
class Host:
    name: str
    netns: str
    address: str
    link: LinkSpec
    agent: subprocess.Popen[bytes] | None = None
    state_dir: Path | None = None
    log_path: Path | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def node_id(self) -> str | None:
        ident = (self.state_dir or Path("/nonexistent")) / "identity.json"
        return json.loads(ident.read_text()).get("node_id") if ident.exists() else None


@dataclass
class Cluster:
    cid: str
    subnet: int
    workdir: Path
    hosts: dict[str, Host]
    url: str = ""
    redis_url: str = ""
    wire_config: Path = Path()
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def root_address(self) -> str:
        return f"10.213.{self.subnet}.1"

    # --- the controller's API -------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {OPERATOR_KEY}"}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=30, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers(), json=body, timeout=120, **kw)

    def logs(self) -> str:
        return "".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:]
            for p in sorted(self.workdir.glob("*.log"))
        )

    def node_ids(self) -> dict[str, str]:
        return {n["name"]: n["id"] for n in self.get("/api/admin/nodes").json()}

    # --- hosts --------------------------------------------------------------------------------
    def ns_popen(self, host: str, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[host].netns, *argv],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kw,
            )

    def ns_run(
        self, host: str, argv: list[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[host].netns, *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def set_link(self, host: str, *, delay_ms: float, rate_mbit: float) -> None:
        """Change a host's link while everything runs (the wire re-reads its config)."""
        h = self.hosts[host]
        h.link = LinkSpec(delay_ms=delay_ms, rate_mbit=rate_mbit)
        _set_tbf(h)
        self._write_wire_config()

    def _write_wire_config(self) -> None:
        links: dict[str, Any] = {
            "root": {
                "netns": None,
                "dev": f"rc{self.cid}",
                "address": self.root_address,
                "delay_ms": 0,
                "rate_mbit": 0,
            }
        }
        for h in self.hosts.values():
            links[h.name] = {
                "netns": h.netns,
                "dev": "eth0",
                "address": h.address,
                "delay_ms": h.link.delay_ms,
                "rate_mbit": h.link.rate_mbit,
            }
        tmp = self.wire_config.with_suffix(".tmp")
        tmp.write_text(json.dumps({"links": links}, indent=1))
        tmp.replace(self.wire_config)

    def start_agent(
        self,
        host: str,
        token: str,
        *,
        models_dir: Path,
        profile: dict[str, Any],
        extra_args: Sequence[str] = (),
    ) -> None:
        h = self.hosts[host]
        h.state_dir = self.workdir / "agents" / host
        h.state_dir.mkdir(parents=True, exist_ok=True)
        prof = h.state_dir / "hardware.json"
        prof.write_text(json.dumps(profile))
        h.log_path = self.workdir / f"agent-{host}.log"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DATABASE_URL", "DJANGO_", "REDIS_URL", "CELERY_"))
        }
        env["GGML_NO_BACKTRACE"] = "1"
        h.agent = self.ns_popen(
            host,
            [
                str(BIN / "node-agent"), "--foreground",
                "--controller-url", self.url,
                "--enrollment-token", token,
                "--node-name", host,
                "--state-dir", str(h.state_dir),
                "--models-dir", str(models_dir),
                "--advertise-address", h.address,
                "--rpc-port", str(RPC_PORT),
                "--hardware-profile", str(prof),
                *extra_args,
            ],
            h.log_path,
            env=env,
        )  # fmt: skip

    def stop_agents(self) -> None:
        for h in self.hosts.values():
            if h.agent is not None and h.agent.poll() is None:
                h.agent.send_signal(signal.SIGTERM)
        for h in self.hosts.values():
            if h.agent is not None:
                try:
                    h.agent.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
                _stop(h.agent, timeout=5)


def _set_tbf(h: Host) -> None:
    if h.link.rate_mbit > 0:
        sh("ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", "eth0", "root",
           "tbf", "rate", f"{h.link.rate_mbit}mbit", "burst", "140kb", "latency", "250ms")  # fmt: skip
    else:
        sh("ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)


def _wait_http(
    url: str, procs: list[subprocess.Popen[bytes]], logs: Any, timeout: float = 90
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"controller process exited with {p.returncode}:\n{logs()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"controller not healthy after {timeout:.0f} s:\n{logs()}")
        time.sleep(0.3)


def _start_hosts(stack: ExitStack, cl: Cluster) -> None:
    """The namespaces, the wire and the root side's TUN device; undone by the stack."""
    workdir, cid = cl.workdir, cl.cid
    for h in cl.hosts.values():
        sh("ip", "netns", "add", h.netns)
        stack.callback(sh, "ip", "netns", "del", h.netns, check=False)
    cl._write_wire_config()
    wire_log = open(workdir / "wire.log", "wb")  # closed by the stack
    stack.callback(wire_log.close)
    wire = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.netwire", str(cl.wire_config)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=wire_log, start_new_session=True,
    )  # fmt: skip
    stack.callback(_stop, wire, 5)
    assert wire.stdout is not None
    if wire.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"netwire failed: {(workdir / 'wire.log').read_text()}")
    root_dev = f"rc{cid}"
    sh("ip", "link", "set", root_dev, "mtu", "65000", "up")
    sh("ip", "addr", "add", f"{cl.root_address}/24", "dev", root_dev)
    for h in cl.hosts.values():
        sh("ip", "-n", h.netns, "link", "set", "lo", "up")
        sh(
            "ip",
            "-n",
            h.netns,
            "link",
            "set",
            "eth0",
            "mtu",
            "65000",
            "txqueuelen",
            "1000",
            "up",
        )
        sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        _set_tbf(h)


def _new_cluster(workdir: Path, links: dict[str, LinkSpec]) -> tuple[Cluster, Path]:
    """A cluster's names and addresses, and its owner file (this process's pid)."""
    cleanup_stale()
    cid = uuid.uuid4().hex[:8]
    workdir.mkdir(parents=True, exist_ok=True)
    OWNERS.mkdir(parents=True, exist_ok=True)
    owner = OWNERS / f"{cid}.pid"
    owner.write_text(str(os.getpid()))
    subnet = _free_subnet()
    hosts = {
        name: Host(
            name=name, netns=f"{PREFIX}{cid}-h{i}", address=f"10.213.{subnet}.{10 + i}", link=spec
        )
        for i, (name, spec) in enumerate(links.items(), start=1)
    }
    cl = Cluster(
        cid=cid, subnet=subnet, workdir=workdir, hosts=hosts, wire_config=workdir / "wire.json"
    )
    return cl, owner


@contextmanager
def namespace_hosts(workdir: Path, links: dict[str, LinkSpec]) -> Iterator[Cluster]:
    """Only the hosts (name → link) and the wire: no controller, no Redis (cl.url is empty).
    For benchmarks that run their own processes in the namespaces (Cluster.ns_popen)."""
    cl, owner = _new_cluster(workdir, links)
    with ExitStack() as stack:
        try:
            _start_hosts(stack, cl)
            yield cl
        finally:
            owner.unlink(missing_ok=True)


@contextmanager
def namespace_cluster(
    workdir: Path, links: dict[str, LinkSpec], **settings: str
) -> Iterator[Cluster]:
    """Hosts (name → link), the wire, a private Redis and the controller (settings: extra
    environment for it); agents are not started."""
    cl, owner = _new_cluster(workdir, links)
    with ExitStack() as stack:
        try:
            _start_hosts(stack, cl)

            taken: set[int] = set()
            (workdir / "redis").mkdir(exist_ok=True)
            # Redis binds 127.0.0.1 too, where another cluster's Redis may hold the port (or
            # take it between the check and the bind): then it exits, and another port is tried.
            # Waiting on the root address, which only this cluster has, sees this Redis only.
            for _attempt in range(5):
                redis_port = free_root_port(cl.root_address, taken, also=("127.0.0.1",))
                redis_proc = subprocess.Popen(
                    [redis_server_binary(), "--bind", "127.0.0.1", cl.root_address, "--port", str(redis_port),
                     "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(workdir / "redis")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                stack.callback(_stop, redis_proc, 5)
                try:
                    _wait_port(cl.root_address, redis_port)
                except RuntimeError:
                    if redis_proc.poll() is None:
                        raise
                    continue
                if redis_proc.poll() is None:
                    break
            else:
                raise RuntimeError("the cluster's Redis did not start on 5 ports in a row")

            port = free_root_port(cl.root_address, taken)
            cl.url = f"http://{cl.root_address}:{port}"
            cl.redis_url = f"redis://127.0.0.1:{redis_port}/0"
            keep = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST_"))}
            cl.env = {
                **keep,
                "DATABASE_URL": f"sqlite:///{workdir / 'controller.sqlite3'}",
                "REDIS_URL": cl.redis_url,
                "CELERY_BROKER_URL": f"redis://127.0.0.1:{redis_port}/1",
                "RACON_AGENT_REDIS_URL": f"redis://{cl.root_address}:{redis_port}/0",
                "NODE_REDIS_ACL": "true",
                "CELERY_TASK_ALWAYS_EAGER": "false",
                "AI_API_KEY": OPERATOR_KEY,
                "NODE_ENROLLMENT_SECRET": "cluster-enrollment-secret",
                "SPEED_CHALLENGE": "false",
                "PORT": str(port),
                "RACON_CONTROLLER_URL": cl.url,
                "RACON_VAR_DIR": str(workdir / "var"),
                "RACON_MODEL_STORE": str(workdir / "store"),
                "HEARTBEAT_INTERVAL": "1",
                "HEALTH_SWEEP_SECONDS": "1",
                "HEARTBEAT_DEGRADED_AFTER": "6",
                "HEARTBEAT_OFFLINE_AFTER": "15",
                "DEBUG": "false",
                "LOG_FORMAT": "json",
                "LOG_LEVEL": "INFO",
                "SECRET_KEY": "cluster-secret-key-" + "k" * 40,
                "CELERY_TASK_DEFAULT_QUEUE": "racon-cluster",
                "CELERY_PLACEMENT_QUEUE": "racon-cluster.placement",
                "API_CACHE_SECONDS": "0",
                "ALLOWED_HOSTS": f"localhost,127.0.0.1,{cl.root_address}",
                # A plain-http controller on a network address gives join lines only with this
                # (issue 24): these clusters test placement and links, not the LAN's trust.
                "RACON_INSECURE_LAN": "1",
                **settings,
            }
            migrate = subprocess.run(
                [sys.executable, "manage.py", "migrate", "--noinput"],
                cwd=ROOT, env=cl.env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if migrate.returncode:
                raise RuntimeError(
                    f"migrate failed:\n{migrate.stdout[-2000:]}{migrate.stderr[-3000:]}"
                )
            for name, argv in (
                ("daphne", [str(BIN / "daphne"), "-b", cl.root_address, "-p", str(port), "racon.asgi:application"]),
                ("celery", [str(BIN / "celery"), "-A", "racon", "worker", "-B", "-l", "info", "--concurrency", "3",
                            "-s", str(workdir / "beat-schedule"), "-n", f"cluster-{cl.cid}@%h",
                            "-Q", "racon-cluster,racon-cluster.placement"]),
            ):  # fmt: skip
                with open(workdir / f"{name}.log", "wb") as log:
                    proc = subprocess.Popen(
                        argv, cwd=ROOT, env=cl.env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                cl.procs.append(proc)
                stack.callback(_stop, proc)
            _wait_http(cl.url, cl.procs, cl.logs)
            stack.callback(cl.stop_agents)
            yield cl
        finally:
            owner.unlink(missing_ok=True)


def _wait_port(host: str, port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{host}:{port} did not open within {timeout:.0f} s")


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def shared_cpu_benchmark(runs: int = 5, budget_s: float = 0.2) -> dict[str, float]:
    """The agents' benchmark (agent.hardware.benchmark), as the median of a few short runs.

    Every host of the cluster shares this machine's cores with whatever else runs on it, so one
    0.5 s sample can be several times off (30 to 280 GFLOPS a minute apart, bench/multihost.py);
    the median of several is steadier. Measure it with the cluster's processes up. The compute
    figure is the agent's claim (never below one BLAS thread's rate: every core at once collapses
    when one is busy, as under ``make test-load``'s burner: 10 GFLOPS against 190 idle)."""
    g = [measure_claim_gflops(budget_s) for _ in range(runs)]
    b = [measure_mem_bandwidth(budget_s) for _ in range(runs)]
    return {"gflops": statistics.median(g), "mem_bandwidth_gbps": statistics.median(b)}


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """SIGTERM a process started with start_new_session (ns_popen) and its group; SIGKILL late."""
    _stop(proc, timeout)


def host_profile(*, ram_bytes: int, benchmark: dict[str, float]) -> dict[str, Any]:
    """A fake hardware profile: this machine's CPU and benchmark, with capped RAM (a forced split)."""
    cores = os.cpu_count() or 2
    return {
        "cpu": {"model": "namespace host", "physical_cores": cores, "logical_cores": cores},
        "memory": {"total": ram_bytes, "available": ram_bytes},
        "benchmark": benchmark,
    }


def links_by_name(cl: Cluster) -> dict[tuple[str, str], dict[str, Any]]:
    ids = {v: k for k, v in cl.node_ids().items()}
    r = redis.Redis.from_url(cl.redis_url, decode_responses=True)
    out = {}
    for pair, raw in r.hgetall("racon:links").items():
        a, _, b = pair.partition("|")
        if a in ids and b in ids:
            out[(ids[a], ids[b])] = json.loads(raw)
    return out
