"""A household LAN on one machine: network namespaces on one bridge (issue 24).

Each host is a network namespace with one veth (`eth0`) whose other end hangs on a bridge that
lives in a namespace of its own (the switch): nothing is added to the root namespace, so the
hosts reach each other and nothing else, like machines on a home switch. Hosts are named after
their role (`controller`, `gpu-desktop`, `ram-box`, `intruder`, and `office-pc`, a machine with no
Python at all); host N has 10.214.0.(10+N)/24. Another role is one more name in the fixture's list
(HOUSEHOLD below).

Names: RACON_NETNS_PREFIX (default `racon-hh-`) plus a random id; a session that sets its own
prefix keeps its namespaces apart from others'. Everything is deleted on exit, after a failure
too; namespaces left by a killed run (owner pid gone) are deleted when the next one starts.

Code runs inside a host either as a process (`ip netns exec`, Household.popen/run) or, for the
test's own HTTP calls, in a thread that has entered the host's namespace (Household.call:
setns(2) on a network namespace applies to the calling thread only).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
IP = shutil.which("ip") or "/usr/sbin/ip"
OWNERS = Path("/run/racon-household")
SUBNET = "10.214.0"


def prefix() -> str:
    return os.environ.get("RACON_NETNS_PREFIX") or "racon-hh-"


@dataclass
class NsHost:
    name: str
    netns: str
    address: str


@dataclass
class Household:
    cid: str
    workdir: Path
    switch: str
    hosts: dict[str, NsHost] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def addr(self, host: str) -> str:
        return self.hosts[host].address

    def run(
        self, host: str, argv: Sequence[str], *, timeout: float = 120, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [IP, "netns", "exec", self.hosts[host].netns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kw,
        )

    def popen(
        self, host: str, argv: Sequence[str], *, log: Path, **kw: Any
    ) -> subprocess.Popen[bytes]:
        """A process in its own session inside the host (stopped with its group at the end)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [IP, "netns", "exec", self.hosts[host].netns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **kw,
            )
        self.procs.append(proc)
        return proc

    def call(self, host: str, fn: Callable[[], T], timeout: float = 600) -> T:
        """fn() in a thread inside the host's network namespace (its sockets stay there)."""
        result: list[Any] = []

        def body() -> None:
            try:
                fd = os.open(f"/var/run/netns/{self.hosts[host].netns}", os.O_RDONLY)
                try:
                    os.setns(fd, os.CLONE_NEWNET)
                finally:
                    os.close(fd)
                result.append(("ok", fn()))
            except BaseException as exc:  # handed back to the caller
                result.append(("err", exc))

        t = threading.Thread(target=body, daemon=True, name=f"netns-{host}")
        t.start()
        t.join(timeout)
        if not result:
            raise TimeoutError(f"call in {host} did not finish within {timeout:.0f} s")
        kind, value = result[0]
        if kind == "err":
            raise value
        return value


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IP, *argv], check=check, capture_output=True, text=True, timeout=30)


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM a process started in its own session, and its group; SIGKILL what is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def cleanup_stale() -> None:
    pattern = re.compile(rf"^{re.escape(prefix())}([0-9a-f]{{8}})-")
    out = _sh("netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = pattern.match(name)
        if not m:
            continue
        owner = OWNERS / f"{m.group(1)}.pid"
        try:
            os.kill(int(owner.read_text()), 0)
            continue
        except (OSError, ValueError):
            pass
        _sh("netns", "del", name, check=False)


@contextmanager
def household(workdir: Path, names: Sequence[str]) -> Iterator[Household]:
    """The hosts `names` on one bridge; deleted (with every process started through it) on exit."""
    cleanup_stale()
    cid = uuid.uuid4().hex[:8]
    workdir.mkdir(parents=True, exist_ok=True)
    OWNERS.mkdir(parents=True, exist_ok=True)
    owner = OWNERS / f"{cid}.pid"
    owner.write_text(str(os.getpid()))
    switch = f"{prefix()}{cid}-switch"
    hh = Household(cid=cid, workdir=workdir, switch=switch)
    made: list[str] = []
    try:
        _sh("netns", "add", switch)
        made.append(switch)
        _sh("-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("-n", switch, "link", "set", "br0", "up")
        for i, name in enumerate(names, start=1):
            ns = f"{prefix()}{cid}-{name}"
            _sh("netns", "add", ns)
            made.append(ns)
            port = f"p{i}"
            _sh(
                "-n",
                switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _sh("-n", switch, "link", "set", port, "master", "br0", "up")
            address = f"{SUBNET}.{10 + i}"
            _sh("-n", ns, "link", "set", "lo", "up")
            _sh("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _sh("-n", ns, "link", "set", "eth0", "up")
            hh.hosts[name] = NsHost(name=name, netns=ns, address=address)
        yield hh
    finally:
        for proc in reversed(hh.procs):
            stop_group(proc)
        for ns in reversed(made):
            _sh("netns", "del", ns, check=False)
        owner.unlink(missing_ok=True)


# --- `BIND=<address> make run` in the controller host, and hosts that join it -------------------

# The household's hosts (issue 24), and the one with no Python at all (issue 26). One topology for
# every LAN test: a new role (a Vulkan desktop, say) is one more name here.
HOUSEHOLD = ("controller", "gpu-desktop", "ram-box", "intruder", "office-pc")
JOINED = ("gpu-desktop", "ram-box")  # the line through join_env (a python3.12 on PATH)
NO_PYTHON = "office-pc"  # the line with env -i and every Python masked

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000  # make run's default: each host has its own ports
# What the test suite's own environment holds (racon/testing.py, .ci/run, pytest-django) and a user
# does not: make run must make its own Redis, database, secrets and URLs.
NOT_A_USERS = (
    "REDIS_URL", "CELERY_BROKER_URL", "RACON_EMBEDDED_REDIS", "NODE_ENROLLMENT_SECRET", "AI_API_KEY",
    "CELERY_TASK_ALWAYS_EAGER", "NODE_REDIS_ACL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY",
    "RACON_ADMIN_PASSWORD", "RACON_REDIS_PASSWORD", "PORT", "RACON_CONTROLLER_URL", "BIND",
    "RACON_AGENT_REDIS_URL", "RACON_VAR_DIR", "RACON_MODEL_STORE", "ALLOWED_HOSTS",
)  # fmt: skip


@dataclass
class LanController:
    """make run in the controller host, as the README says: `BIND=<address> make run`."""

    hh: Household
    proc: subprocess.Popen[bytes]
    var: Path
    log_path: Path

    @property
    def address(self) -> str:
        return self.hh.addr("controller")

    @property
    def public_url(self) -> str:
        return f"https://{self.address}:{PORT}"

    @property
    def local_url(self) -> str:
        return f"http://127.0.0.1:{PORT}"

    @property
    def ca_file(self) -> Path:
        return self.var / "tls" / "ca.crt"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def secret(self, key: str) -> str:
        for line in (self.var / ".env.local").read_text().splitlines():
            k, _, v = line.partition("=")
            if k == key:
                return v
        raise KeyError(key)

    def api(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Any:
        """The admin API from inside the controller host, on loopback (plain HTTP there)."""
        import httpx

        key = self.secret("AI_API_KEY")

        def go() -> httpx.Response:
            return httpx.request(
                method,
                self.local_url + path,
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=timeout,
            )

        return self.hh.call("controller", go)

    def racon(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The `racon` CLI in the controller host, with the operator's key."""
        return self.hh.run(
            "controller",
            [str(ROOT / ".venv" / "bin" / "racon"), "--url", self.local_url,
             "--key", self.secret("AI_API_KEY"), *args],
        )  # fmt: skip


def user_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_A_USERS}
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_", "DJANGO_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def start_make_run(hh: Household, var: Path, model: Path | None) -> LanController:
    """`BIND=<controller address> make run` in the controller host, with a var dir of its own
    (holding the model a user would have downloaded): no test-only Redis, database or URL."""
    var.mkdir(parents=True, exist_ok=True)
    if model is not None:
        store = var / "models"
        store.mkdir(exist_ok=True)
        target = store / model.name
        if not target.exists():
            try:
                os.link(model, target)
            except OSError:
                shutil.copy(model, target)
    log_path = hh.workdir / "make-run.log"
    env = user_env(BIND=hh.addr("controller"), RACON_VAR_DIR=str(var))
    make = shutil.which("make") or "make"
    argv = [make, "-s", "-C", str(ROOT), "run"]
    if os.environ.get("RACON_HOUSEHOLD_NO_MAKE"):
        # A developer's checkout whose install stamp is stale (make would install first):
        # make run's own last step. CI never sets it.
        argv = [str(ROOT / ".venv" / "bin" / "python"), "-m", "racon.launcher"]
    proc = hh.popen("controller", argv, log=log_path, env=env, cwd=str(ROOT))
    return LanController(hh=hh, proc=proc, var=var, log_path=log_path)


@dataclass
class HouseholdLan:
    """The README's household: the controller's make run and two machines joined with the line."""

    hh: Household
    ctl: LanController
    line: str
    joins: dict[str, subprocess.Popen[bytes]]
    homes: dict[str, Path]
    # Seconds from each host's line to its node READY, and the bundle the controller serves.
    ready_after: dict[str, float] = field(default_factory=dict)
    bundle: Path | None = None


def join_env(hh: Household, host: str, home: Path, **extra: str) -> dict[str, str]:
    """A machine that never saw the repository (tests/support/join.py clean_env)."""
    from tests.support.join import clean_env

    # A machine's own choice of llama.cpp backends travels with it (README, GPU nodes).
    backends = (
        {"RACON_LLAMA_BACKENDS": os.environ["RACON_LLAMA_BACKENDS"]}
        if os.environ.get("RACON_LLAMA_BACKENDS")
        else {}
    )
    return clean_env(home, {**backends, **extra}, RACON_NODE_NAME=host, GGML_NO_BACKTRACE="1")


def run_line(
    hh: Household, host: str, line: str, *, home: Path, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """The line, pasted into a shell on `host`, from a scratch directory (never the checkout)."""
    (home / "work").mkdir(parents=True, exist_ok=True)
    return hh.popen(host, ["sh", "-c", line], log=log, cwd=home / "work", env=env)


def run_line_without_python(
    hh: Household, host: str, line: str, *, home: Path, log: Path, **extra: str
) -> subprocess.Popen[bytes]:
    """The line on a machine with no Python at all (issue 26): `env -i` with a PATH of /usr/bin:/bin,
    in a mount namespace where every Python of this machine is masked (tests/cluster/no_python.py):
    the system's, pyenv's, the checkout's .venv and ~/.cache/racon."""
    from .no_python import without_python

    (home / "work").mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", **extra}
    if os.environ.get("RACON_LLAMA_BACKENDS"):  # a machine's own choice travels with it
        env["RACON_LLAMA_BACKENDS"] = os.environ["RACON_LLAMA_BACKENDS"]
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "sh", "-c", line]
    return hh.popen(
        host,
        without_python(argv, hh.workdir / "empty"),
        log=log,
        cwd=home / "work",
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )


def token_line(ctl: LanController, label: str, max_uses: int) -> str:
    """The join line exactly as `racon tokens create` prints it."""
    out = ctl.racon("tokens", "create", label, "--max-uses", str(max_uses))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("curl ")]
    assert lines, out.stdout
    return lines[0]
