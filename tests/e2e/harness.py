"""Real processes for end-to-end tests: the controller (daphne + Celery) and node agents."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

from racon import ids
from racon.serve import bind_listener, start_daphnes
from tests.support import processes, timing
from tests.support.processes import free_port, stop, wait_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The live controller's SECRET_KEY: a test that signs a command as the controller does uses it.
SECRET_KEY = "e2e-secret-key-" + "k" * 40


def smollm2_path() -> Path:
    """The real SmolLM2 GGUF (FACTS.md): see tests/smollm2.py."""
    from tests.smollm2 import smollm2_path as find

    return find()


@dataclass
class Controller:
    url: str
    env: dict[str, str]
    workdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)  # daphne
    beat: bool = True
    worker: subprocess.Popen[bytes] | None = None

    @property
    def api_key(self) -> str:
        return self.env["AI_API_KEY"]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=30, **kw)

    def post(self, path: str, json_body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers(), json=json_body, timeout=60, **kw)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("*.log")))

    @property
    def queue(self) -> str:
        return self.env["CELERY_TASK_DEFAULT_QUEUE"]

    def worker_up(self) -> None:
        """Start the Celery worker (``beat``: it runs the beat schedule) unless it runs; wait for
        /health to count it. A controller started with ``worker="tasks"`` runs no beat."""
        if self.worker is not None and self.worker.poll() is None:
            return
        n = len(list(self.workdir.glob("celery*.log")))
        argv = [str(BIN / "celery"), "-A", "racon", "worker", "-l", "info", "--concurrency", "3"]
        if self.beat:
            argv += ["-B", "-s", str(self.workdir / "beat-schedule")]
        queues = f"{self.queue},{self.env['CELERY_PLACEMENT_QUEUE']}"
        argv += ["-n", f"{self.queue}-{n}@%h", "-Q", queues]
        self.worker = processes.start(argv, log_path=self.workdir / f"celery-{n}.log", env=self.env)
        self.wait_healthy()

    def worker_down(self) -> None:
        """Stop the worker and wait until none of its processes is left: then no task of it (a
        sweep, a placement, a settlement) touches the database (before a test's flush)."""
        if self.worker is not None:
            stop(self.worker, timeout=timing.scaled(20))
            processes.group_gone(self.worker)
            self.worker = None

    def wait_healthy(self) -> None:
        """Until /health answers 200 (without a worker: answers at all, since Celery counts
        there); a process that exits fails at once, with the logs."""
        procs = [*self.procs, *([self.worker] if self.worker is not None else [])]

        def healthy() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"controller process exited with {p.returncode}:\n{self.logs()[-3000:]}"
                    )
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                return False
            return status == 200 or self.worker is None

        try:
            wait_for(healthy, timing.scaled(60), "the controller's /health", interval=0.3)
        except AssertionError as exc:
            raise RuntimeError(f"{exc}:\n{self.logs()[-3000:]}") from None


# Controllers that outlive a test (a session's): tests/conftest.py stops each one's worker before
# a transactional test's flush and starts it again for the next test that uses a live controller.
LIVE: list[Controller] = []
# Agents started and not stopped yet, and the last few stopped: a failing test's report carries
# their logs' tails.
AGENTS: list[AgentProc] = []
STOPPED: deque[AgentProc] = deque(maxlen=3)


@contextmanager
def shared(ctl: Controller) -> Iterator[Controller]:
    """``ctl`` outlives tests (a session fixture's): while in ``LIVE``, its worker is stopped before
    each transactional test's flush (``Controller.worker_down``) and started again before the next
    test that uses it (``worker_up``)."""
    LIVE.append(ctl)
    try:
        yield ctl
    finally:
        LIVE.remove(ctl)


def database_url() -> str:
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{Path(s['NAME']).resolve()}"
    user = s.get("USER") or "postgres"
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    pw = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    return f"postgres://{user}{pw}@{host}:{port}/{s['NAME']}"


@contextmanager
def run_controller(
    workdir: Path, *, worker: str = "beat", **overrides: str
) -> Iterator[Controller]:
    """daphne and a Celery worker, on the test database and test Redis.

    ``worker``: ``"beat"`` (the worker runs the beat schedule, as ``make run`` does) or ``"tasks"``
    (no beat). Without a ``DAPHNE_PROCESSES`` override, one plain ``daphne``; with it (N), the
    server layer ``make run`` runs (racon/serve.py, the launcher reads the same variable): N
    racon-daphne processes on one listening socket, with its limits and without an access line
    per request (the benchmarks use it, to measure what users get). A controller that outlives
    tests goes through ``shared`` as well.
    """
    if worker not in ("beat", "tasks"):
        raise ValueError(f"worker must be beat or tasks, not {worker!r}")
    daphnes = int(overrides.get("DAPHNE_PROCESSES") or 0)
    sock = bind_listener("127.0.0.1", 0) if daphnes else None
    port = sock.getsockname()[1] if sock is not None else free_port()
    url = f"http://127.0.0.1:{port}"
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "PORT": str(port),
        "RACON_CONTROLLER_URL": url,
        "RACON_VAR_DIR": str(workdir / "var"),
        "RACON_MODEL_STORE": str(workdir / "store"),
        **timing.heartbeat_env(),
        "DEBUG": "false",
        "LOG_FORMAT": "json",
        "LOG_LEVEL": "INFO",
        "SECRET_KEY": SECRET_KEY,
        # Live controllers of one test session share the test Redis: each gets its own task queue.
        "CELERY_TASK_DEFAULT_QUEUE": (queue := f"racon-e2e-{port}"),
        # One worker takes both of its queues here (settings: placement has its own queue).
        "CELERY_PLACEMENT_QUEUE": f"{queue}.placement",
        # Session-wide live controllers outlive each test's database flush, which no cache hears
        # about (TRUNCATE sends no signal); tests/api/test_caches.py covers caching itself.
        "API_CACHE_SECONDS": "0",
        # Celery yields to the request path here too, but less than make run's default (10): a
        # test machine is often busy (make test-load runs a 1-core burner), and a worker at nice
        # 10 there gets a tenth of a contended core, which tests waiting on a settlement or a
        # placement would feel. tests/e2e/test_background_priority.py checks it is applied.
        "RACON_BACKGROUND_NICE": "3",
        **overrides,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    ctl = Controller(url=url, env=env, workdir=workdir, beat=worker == "beat")
    try:
        if sock is None:
            argv = [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port)]
            ctl.procs.append(
                processes.start(
                    [*argv, "racon.asgi:application"], log_path=workdir / "daphne.log", env=env
                )
            )
        else:
            with open(workdir / "daphne.log", "ab") as log:
                ctl.procs += start_daphnes(
                    sock, daphnes, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
        ctl.worker_up()
        yield ctl
    finally:
        ctl.worker_down()
        for p in ctl.procs:
            stop(p)
        if sock is not None:
            sock.close()


@dataclass
class AgentProc:
    name: str
    proc: subprocess.Popen[bytes]
    state_dir: Path
    rpc_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def node_id(self) -> str | None:
        ident = self.state_dir / "identity.json"
        if ident.exists():
            return json.loads(ident.read_text()).get("node_id")
        return None


def start_agent(
    ctl: Controller,
    token: str,
    name: str,
    workdir: Path,
    *,
    models_dir: Path | None = None,
    extra: list[str] | None = None,
) -> AgentProc:
    state = workdir / "agents" / name
    state.mkdir(parents=True, exist_ok=True)
    models = models_dir or (state / "models")
    models.mkdir(parents=True, exist_ok=True)
    rpc_port = free_port()
    log_path = workdir / f"agent-{name}.log"
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")
    }
    env["GGML_NO_BACKTRACE"] = "1"
    proc = processes.start(
        [
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
            str(models),
            "--advertise-address",
            "127.0.0.1",
            "--rpc-port",
            str(rpc_port),
            "--no-benchmark",
            # One thread each: two llama-servers of two threads on a busy two-core machine stall
            # one another (and each test's timing). A test's own --max-threads comes later and wins.
            "--max-threads",
            "1",
            *(extra or []),
        ],
        log_path=log_path,
        env=env,
    )
    agent = AgentProc(name=name, proc=proc, state_dir=state, rpc_port=rpc_port, log_path=log_path)
    AGENTS.append(agent)
    return agent


def stop_agent(agent: AgentProc, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Signal the agent alone (it drains and stops its children), then clean up its group."""
    if agent.proc.poll() is None:
        agent.proc.send_signal(sig)
        try:
            agent.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    stop(agent.proc, signal.SIGKILL, timeout=5)
    if agent in AGENTS:
        AGENTS.remove(agent)
        STOPPED.append(agent)


def failure_sections(lines: int = 40) -> list[tuple[str, str]]:
    """What a failing test's report adds: the tail of each running agent's log, and each live
    controller's warnings and errors (its logs are JSON lines), so a failure in CI, whose files
    are gone, still says what the agents and the controller saw."""
    out = []
    for agent in [*STOPPED, *AGENTS]:
        tail = agent.log().splitlines()[-lines:]
        how = "running" if agent in AGENTS else "stopped"
        out.append((f"agent {agent.name} ({how}) log, last lines", "\n".join(tail)))
    for ctl in LIVE:
        said = [
            line
            for path in sorted(ctl.workdir.glob("*.log"))
            for line in path.read_text(errors="replace").splitlines()
            if '"WARNING"' in line or '"ERROR"' in line or "Traceback" in line
        ]
        out.append(
            (f"live controller {ctl.url} warnings and errors, last", "\n".join(said[-lines:]))
        )
    return out


def consumer_headers(name: str) -> dict[str, str]:
    """The auth headers of a new account's inference key."""
    _, key = make_account_with_key(name)
    return {"Authorization": f"Bearer {key}"}


@contextmanager
def agents_serving_model(
    ctl: Controller, model_path: Path, workdir: Path, names: tuple[str, ...], model: str
) -> Iterator[tuple[dict[str, AgentProc], dict[str, dict[str, Any]]]]:
    """One agent per name (each enrolled with a token of its own ``owner-<name>`` account), all
    sharing one models dir that holds ``model_path`` (a hard link, a copy across file systems);
    once every node is READY, ``model_path`` is registered as ``model``. Yields (the agents, the
    READY node records, both by name); stops the agents after, however the block ended."""
    models_dir = workdir / "models"
    models_dir.mkdir()
    try:
        os.link(model_path, models_dir / model_path.name)
    except OSError:
        shutil.copy(model_path, models_dir / model_path.name)
    agents: dict[str, AgentProc] = {}
    try:
        for name in names:
            acct_id, _ = make_account_with_key(f"owner-{name}")
            tok = ctl.post("/api/admin/tokens", {"label": name, "account": acct_id})
            assert tok.status_code == 201, tok.text
            agents[name] = start_agent(
                ctl, tok.json()["token"], name, workdir, models_dir=models_dir
            )

        def ready_nodes() -> dict[str, dict[str, Any]] | None:
            got = {
                n["name"]: n
                for n in ctl.get("/api/admin/nodes?state=READY").json()
                if n["name"] in names
            }
            return got if len(got) == len(names) else None

        nodes = wait_for(ready_nodes, 90, f"{len(names)} READY nodes")
        created = ctl.post("/api/admin/models", {"path": str(model_path), "name": model})
        assert created.status_code == 201, created.text
        yield agents, nodes
    finally:
        for agent in agents.values():
            stop_agent(agent)


# serving_agents (tests/e2e/conftest.py): (label, node names, model name) → agents_serving_model's
# (agents, READY node records).
StartAgents = Callable[
    [str, tuple[str, ...], str], tuple[dict[str, AgentProc], dict[str, dict[str, Any]]]
]


def chat_ok(ctl: Controller, headers: dict[str, str], body: dict[str, Any]) -> httpx.Response:
    """POST /v1/chat/completions (not streamed), asserting 200."""
    resp = httpx.post(ctl.url + "/v1/chat/completions", json=body, headers=headers, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp


def replica_per_node(
    ctl: Controller, model: str, names: tuple[str, ...], **request: Any
) -> dict[str, str]:
    """One deployment of ``model`` pinned to each named node (``request``: n_ctx, n_parallel...),
    all READY (none FAILED or STOPPED on the way); their ids by node name."""
    deps: dict[str, str] = {}
    for name in names:
        dep = ctl.post("/api/admin/deployments", {"model": model, "nodes": [name], **request})
        assert dep.status_code == 202, dep.text
        deps[name] = dep.json()["id"]

    def ready(dep_id: str) -> bool:
        d = ctl.get(f"/api/admin/deployments/{dep_id}").json()
        assert d["state"] not in ("FAILED", "STOPPED"), d
        return bool(d["state"] == "READY")

    for dep_id in deps.values():
        wait_for(functools.partial(ready, dep_id), 180, "every replica READY")
    return deps


def make_account_with_key(name: str, *, grant: int | None = None) -> tuple[str, str]:
    """A new account (its balance set to ``grant`` if given) and an inference key: (id, key)."""
    from apps.accounts.models import Account
    from apps.api.auth import api_key_create
    from apps.credits.ledger import account_create

    acct = account_create(name=name)
    if grant is not None:
        # Drain the starting grant to a chosen balance (a correction is a new entry).
        from apps.credits.ledger import credit_adjust

        delta = grant - Account.objects.get(pk=acct.pk).balance
        if delta:
            from django.utils import timezone

            credit_adjust(
                account_id=ids.account_id(acct.pk),
                amount=delta,
                reason="test setup",
                now=timezone.now(),
            )
    _, key = api_key_create(
        name=f"{name}-key", account_id=ids.account_id(acct.pk), scopes=["inference"]
    )
    return str(acct.pk), key


def stream_chat(
    controller: Controller, headers: dict[str, str], body: dict[str, Any], on_chunk: Any = None
) -> dict[str, Any]:
    """POST a streamed chat to the controller; the text, chunk count and times, usage and error
    (``on_chunk(out)`` after each content chunk)."""
    out: dict[str, Any] = {
        "text": "",
        "chunks": 0,
        "times": [],
        "usage": [],
        "error": None,
        "done": False,
    }
    with (
        httpx.Client(timeout=240) as c,
        connect_sse(
            c, "POST", controller.url + "/v1/chat/completions", json=body, headers=headers
        ) as sse,
    ):
        out["job"] = sse.response.headers.get("x-racon-job-id")
        out["node"] = sse.response.headers.get("x-racon-nodes")
        for ev in sse.iter_sse():
            if ev.data == "[DONE]":
                out["done"] = True
                break
            data = json.loads(ev.data)
            if "error" in data:
                out["error"] = data["error"]
                continue
            if data.get("usage"):
                out["usage"].append(data["usage"])
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    out["text"] += piece
                    out["chunks"] += 1
                    out["times"].append(time.monotonic())
                    if on_chunk is not None:
                        on_chunk(out)
    return out
