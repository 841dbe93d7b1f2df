"""A whole local RACoN cluster for benchmarks, started and stopped by one context manager.

    with local_cluster(n_agents=1) as cl:
        dep = cl.deploy(["bench-1"], n_ctx=512)
        ...

What it starts, all on loopback, all stopped on exit (also on errors and Ctrl-C):

- its own Redis: the embedded redis-server (FACTS.md) when REDIS_URL is unset (nodes get their
  own Redis users, NODE_REDIS_ACL, as in production), else REDIS_URL with dedicated database
  numbers (11 for the app, 10 for Celery's broker; only those two are flushed, so two runs against
  one REDIS_URL at once would disturb each other) and NODE_REDIS_ACL=false: a node's own user may
  not SELECT a numbered database;
- its own SQLite database file in a temporary directory (migrated here);
- the controller (daphne + a Celery worker with beat) through tests/e2e/harness.run_controller,
  with make run's server layer (SERVER_PROCESSES racon-daphne processes on one socket), its
  in-process caches on, and production heartbeat timings, so that what is measured is what a
  real deployment has;
- N real `node-agent` processes sharing one models directory that holds SmolLM2. They run their
  compute/bandwidth benchmark at start (unlike the e2e tests' --no-benchmark), one after the
  other so that no benchmark shares the CPUs with another, because the scheduler's predictions
  depend on those figures.

Django is configured in this process too (harness.database_url() needs it, and the scheduler
bench reads the cluster snapshot the controller's scheduler sees).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.harness import (  # noqa: E402
    BIN,
    AgentProc,
    Controller,
    free_port,
    run_controller,
    smollm2_path,
    stop_agent,
    wait_for,
)

MODEL_NAME = "smollm2"
APP_REDIS_DB = 11  # 12 is bench/heartbeats.py's, 13-15 the test suites'
BROKER_REDIS_DB = 10

# The settings' defaults (racon/settings.py), not the e2e harness's 1 s sweeps: a benchmark should
# see the background work a real controller does, no more.
PRODUCTION_TIMINGS = {
    "HEARTBEAT_INTERVAL": "5",
    "HEALTH_SWEEP_SECONDS": "5",
    "HEARTBEAT_DEGRADED_AFTER": "3",
    "HEARTBEAT_OFFLINE_AFTER": "9",
    # The e2e harness turns the in-process caches off (its controllers outlive each test's
    # database flush); a benchmark measures them as make run has them (the settings' default).
    "API_CACHE_SECONDS": "10",
    "RACON_BACKGROUND_NICE": "10",  # Celery yields the CPU to the engine, as in make run
}
# make run's server layer (racon/launcher.py): as many daphne processes as cores, at most 2, on
# one listening socket, no access line per request.
SERVER_PROCESSES = min(2, os.cpu_count() or 1)

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def load_average() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average n/a"
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


# --- environment: Redis, database, Django ---------------------------------------------------------


@dataclass
class BenchEnv:
    workdir: Path
    redis_url: str
    broker_url: str
    embedded: Any = None  # racon.embedded.EmbeddedRedis when we started one

    def redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis_url, decode_responses=True)


def _with_db(url: str, db: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


@contextmanager
def bench_environment(workdir: Path) -> Iterator[BenchEnv]:
    """Own Redis and SQLite database, secrets, and Django set up in this process (once)."""
    import redis

    workdir.mkdir(parents=True, exist_ok=True)
    embedded = None
    if os.environ.get("REDIS_URL"):
        app_url = _with_db(os.environ["REDIS_URL"], APP_REDIS_DB)
        broker_url = _with_db(os.environ["REDIS_URL"], BROKER_REDIS_DB)
        # A node's own Redis user (NODE_REDIS_ACL) may not SELECT, so it cannot reach a numbered
        # database, and the ACLs of a shared Redis are not a bench's to change: the nodes get the
        # controller's URL here (the agents inherit this). The embedded Redis below keeps per-node
        # users, as in production (database 0 needs no SELECT).
        os.environ["NODE_REDIS_ACL"] = "false"
    else:
        from racon.embedded import start_redis

        embedded = start_redis(data_dir=workdir / "redis")
        app_url, broker_url = _with_db(embedded.url, 0), _with_db(embedded.url, 1)
    env = BenchEnv(workdir=workdir, redis_url=app_url, broker_url=broker_url, embedded=embedded)
    flush = [redis.Redis.from_url(u) for u in (app_url, broker_url)]
    try:
        for r in flush:
            r.flushdb()
        os.environ.update(
            {
                "DJANGO_SETTINGS_MODULE": "racon.settings",
                "REDIS_URL": app_url,
                "CELERY_BROKER_URL": broker_url,
                "RACON_VAR_DIR": str(workdir / "var"),
                "DATABASE_URL": f"sqlite:///{(workdir / 'bench.sqlite3').resolve()}",
                "CELERY_TASK_ALWAYS_EAGER": "false",
                "DEBUG": "false",
            }
        )
        for key in ("AI_API_KEY", "NODE_ENROLLMENT_SECRET"):
            os.environ.setdefault(key, "bench-" + secrets.token_urlsafe(24))
        os.environ.pop("RACON_AGENT_REDIS_URL", None)
        import django
        from django.core.management import call_command

        django.setup()
        for noisy in (
            "httpx",
            "httpcore",
        ):  # one INFO line per request would drown the bench output
            logging.getLogger(noisy).setLevel(logging.WARNING)
        call_command("migrate", verbosity=0, interactive=False)
        yield env
    finally:
        try:
            from django.db import connections

            connections.close_all()  # this process's handle on the bench database
        except Exception:  # Django may not have been set up
            pass
        for r in flush:
            try:
                r.flushdb()
                r.close()
            except redis.RedisError:
                pass
        if embedded is not None:
            embedded.stop()


# --- agents -----------------------------------------------------------------------------------------


def host_profile(models_dir: Path, cores: int) -> dict[str, Any]:
    """This machine as the agent detects it, posing with `cores` CPU cores (the plan's n_threads)."""
    from agent.hardware import psutil_detector as hw

    cpu = dict(hw.detect_cpu())
    cpu["physical_cores"] = cpu["logical_cores"] = cores
    return {
        "cpu": cpu,
        "memory": hw.detect_memory(),
        "swap": hw.detect_swap(),
        "disk": hw.detect_disk(models_dir),
        "network": hw.detect_network(),
        "gpus": [],
    }


def start_bench_agent(
    ctl: Controller,
    token: str,
    name: str,
    workdir: Path,
    *,
    models_dir: Path,
    benchmark: bool = True,
    cores: int | None = None,
) -> AgentProc:
    """tests/e2e/harness.start_agent, but the agent measures its compute and memory bandwidth.

    cores: pose as a machine with that many cores (a hardware profile built from the real
    detection), which sets the plan's n_threads; None keeps the real detection.
    """
    state = workdir / "agents" / name
    state.mkdir(parents=True, exist_ok=True)
    rpc_port = free_port()
    log_path = workdir / f"agent-{name}.log"
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")
    }
    env["GGML_NO_BACKTRACE"] = "1"
    argv = [
        str(BIN / "node-agent"),
        "--foreground",
        "--controller-url",
        ctl.url,
        "--enrollment-token",
        token,
        "--node-name",
        name,
        "--state-dir",
        str(state),
        "--models-dir",
        str(models_dir),
        "--advertise-address",
        "127.0.0.1",
        "--rpc-port",
        str(rpc_port),
    ]
    if not benchmark:
        argv.append("--no-benchmark")
    if cores is not None:
        import json

        profile = state / "hardware-profile.json"
        profile.write_text(json.dumps(host_profile(models_dir, cores)))
        argv += ["--hardware-profile", str(profile)]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
        )
    return AgentProc(name=name, proc=proc, state_dir=state, rpc_port=rpc_port, log_path=log_path)


# --- the cluster ----------------------------------------------------------------------------------


@dataclass
class Cluster:
    env: BenchEnv
    ctl: Controller
    workdir: Path
    model_path: Path
    agents: list[AgentProc] = field(default_factory=list)
    log: Log = _quiet

    @property
    def node_names(self) -> list[str]:
        return [a.name for a in self.agents]

    def nodes(self) -> list[dict[str, Any]]:
        resp = self.ctl.get("/api/admin/nodes")
        resp.raise_for_status()
        return list(resp.json())

    def deploy(
        self,
        nodes: list[str],
        *,
        spread: bool = True,
        n_ctx: int = 512,
        timeout: float = 300,
        n_parallel: int | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """A deployment of SmolLM2 pinned to `nodes`; returns its detail once READY."""
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "nodes": nodes,
            "spread": spread,
            "n_ctx": n_ctx,
            **extra,
        }
        if n_parallel is not None:
            body["n_parallel"] = n_parallel
        resp = self.ctl.post("/api/admin/deployments", body)
        if resp.status_code != 202:
            raise RuntimeError(f"deployment refused ({resp.status_code}): {resp.text[:500]}")
        dep_id = resp.json()["id"]
        t0 = time.monotonic()

        def ready() -> Any:
            d = self.ctl.get(f"/api/admin/deployments/{dep_id}").json()
            if d["state"] in ("FAILED", "STOPPED"):
                raise RuntimeError(
                    f"deployment {dep_id} {d['state']}: {d.get('error')}\n{self.tail_logs()}"
                )
            return d if d["state"] == "READY" else None

        detail = wait_for(ready, timeout, f"deployment over {nodes} to be READY", interval=0.5)
        self.log(f"  deployment over {','.join(nodes)} READY in {time.monotonic() - t0:.1f} s")
        return detail

    def stop_deployment(self, dep_id: str, *, settle: float = 30) -> None:
        """Stop it, and wait until no node still runs its primary (RPC workers serve one at a time)."""
        self.ctl.post(f"/api/admin/deployments/{dep_id}/stop")
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline and self._primary_alive(dep_id):
            time.sleep(0.3)
        time.sleep(1.0)  # the RPC workers notice the primary's disconnect

    def _primary_alive(self, dep_id: str) -> bool:
        """Whether a primary process of this deployment is still running (from /proc, loopback only)."""
        needle = dep_id.encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                cmd = (pid_dir / "cmdline").read_bytes()
            except OSError:
                continue
            if b"llama-server" in cmd and needle in cmd:
                return True
        return False

    def job(self, job_id: str) -> dict[str, Any]:
        resp = self.ctl.get(f"/api/admin/jobs/{job_id}")
        resp.raise_for_status()
        return dict(resp.json())

    def tail_logs(self, n: int = 3000) -> str:
        parts = [f"--- controller ---\n{self.ctl.logs()[-n:]}"]
        parts += [f"--- agent {a.name} ---\n{a.log()[-n:]}" for a in self.agents]
        return "\n".join(parts)


def _link_model(model_path: Path, models_dir: Path) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    dest = models_dir / model_path.name
    if dest.exists():
        return
    try:
        os.link(model_path, dest)
    except OSError:
        shutil.copy(model_path, dest)


@contextmanager
def local_cluster(
    n_agents: int,
    *,
    workdir: Path | None = None,
    benchmark: bool = True,
    keep: bool = False,
    log: Log = _quiet,
    name_prefix: str = "bench",
    cores: int | None = None,
) -> Iterator[Cluster]:
    """Redis, database, controller, n_agents READY agents and the registered model; torn down on exit."""
    own_tmp = workdir is None
    root = Path(tempfile.mkdtemp(prefix="racon-bench-")) if workdir is None else workdir
    model_path = smollm2_path()
    agents: list[AgentProc] = []
    old_handler = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:  # turn SIGTERM into a clean teardown
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass
    try:
        with bench_environment(root) as env:
            t0 = time.monotonic()
            with run_controller(
                root / "controller", DAPHNE_PROCESSES=str(SERVER_PROCESSES), **PRODUCTION_TIMINGS
            ) as ctl:
                log(f"  controller up at {ctl.url} in {time.monotonic() - t0:.1f} s")
                cl = Cluster(
                    env=env, ctl=ctl, workdir=root, model_path=model_path, agents=agents, log=log
                )
                models_dir = root / "models"
                _link_model(model_path, models_dir)
                try:
                    for i in range(n_agents):
                        name = f"{name_prefix}-{i + 1}"
                        tok = ctl.post("/api/admin/tokens", {"label": name})
                        if tok.status_code != 201:
                            raise RuntimeError(f"token refused: {tok.status_code} {tok.text[:300]}")
                        t1 = time.monotonic()
                        agents.append(
                            start_bench_agent(
                                ctl,
                                tok.json()["token"],
                                name,
                                root,
                                models_dir=models_dir,
                                benchmark=benchmark,
                                cores=cores,
                            )
                        )

                        def is_ready(name: str = name) -> bool:
                            agent = agents[-1]
                            if agent.proc.poll() is not None:
                                raise RuntimeError(
                                    f"agent {name} exited with {agent.proc.returncode}:\n{agent.log()[-3000:]}"
                                )
                            return any(
                                n["name"] == name
                                for n in ctl.get("/api/admin/nodes?state=READY").json()
                            )

                        wait_for(is_ready, 180, f"agent {name} to be READY", interval=0.3)
                        log(f"  agent {name} READY in {time.monotonic() - t1:.1f} s")
                    reg = ctl.post(
                        "/api/admin/models", {"path": str(model_path), "name": MODEL_NAME}
                    )
                    if reg.status_code != 201:
                        raise RuntimeError(
                            f"model registration failed: {reg.status_code} {reg.text[:300]}"
                        )
                    yield cl
                finally:
                    for agent in reversed(agents):
                        stop_agent(agent, timeout=15)
    finally:
        try:
            signal.signal(signal.SIGTERM, old_handler)
        except ValueError:
            pass
        if own_tmp and not keep:
            shutil.rmtree(root, ignore_errors=True)
        elif keep:
            print(f"(bench files kept in {root})", file=sys.stderr)


class CpuMeter:
    """user+system CPU seconds of named process trees, as deltas between two readings."""

    def __init__(self, procs: dict[str, list[int]], children: set[str]) -> None:
        import psutil

        self.ps = {name: [psutil.Process(p) for p in pids] for name, pids in procs.items()}
        self.children = children

    def read(self) -> dict[str, float]:
        import psutil

        out: dict[str, float] = {}
        for name, procs in self.ps.items():
            total = 0.0
            for p in procs:
                tree = [p] + (p.children(recursive=True) if name in self.children else [])
                for q in tree:
                    try:
                        t = q.cpu_times()
                        total += t.user + t.system
                    except psutil.Error:
                        pass
            out[name] = total
        return out
