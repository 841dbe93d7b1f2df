"""The reliability suite's cluster and the steps of one scenario.

The cluster is a real `python -m racon.launcher --agents 2` (what `make run` starts): its own
embedded Redis (REDIS_URL unset, so the launcher owns it and the test may kill it), SQLite in a
temporary RACON_VAR_DIR, and SmolLM2 (the cached GGUF, registered from the model store, so no
network) on two replicas, one per agent. A scenario puts 8 concurrent streaming chat requests on
it through /v1/chat/completions with the operator key, kills one process with SIGKILL, then
measures what the client lost, how long until a retry succeeded, and whether the cluster settled
(no open job, no open hold, a ledger that verifies).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psutil

from tests.launcher.harness import SUITE_ONLY, Launcher, alive, is_agent, wait_for
from tests.smollm2 import smollm2_path
from tests.support import timing

ROOT = Path(__file__).resolve().parents[2]
PORTS = range(19500, 19600)  # this suite's ports (the controller's and the agents' RPC ports)
READY_TIMEOUT = timing.scaled(300.0)  # migrations, two agents and two model loads on 2 shared cores
STREAMS = 8  # concurrent streaming clients during a kill
REQUESTS_PER_STREAM = 2  # each client's requests, one after the other: 16 per scenario
MAX_TOKENS = 32
# One request, start to end: about 3 s when nothing is killed, but the 2 cores are shared. A
# stream silent for STREAM_GAP is lost too: the controller should have ended it by then.
REQUEST_DEADLINE = timing.scaled(60.0)
STREAM_GAP = 20.0
RECOVER_DEADLINE = timing.scaled(120.0)  # the retry loop after a kill
# The stale-jobs sweep runs every 30 s and fails a job silent for 2 stream idle limits.
SETTLE_DEADLINE = timing.scaled(60.0)
GHOST_GRACE = 10.0  # a READY deployment without its llama-server this long is stopped by the test
GHOST_NOTE = "no llama-server for"  # in the note the test leaves when it had to do so
REDEPLOY_AFTER = 10.0  # fewer than two active replicas this long: the test deploys one
STREAM_IDLE_TIMEOUT = 15  # the cluster's STREAM_IDLE_TIMEOUT_SECONDS (default 60): settles in time
PROMPT = "Count from one to one hundred in words, separated by commas."
SERVING = ("READY",)
ACTIVE = ("PLANNING", "LOADING", "READY", "DEGRADED")
OPEN_JOB_STATES = ("QUEUED", "DISPATCHED", "RUNNING")


def take_port(*, count: int = 1) -> int:
    """The first of `count` consecutive free loopback ports in PORTS (in random order, so two
    runs at once rarely race for the same one)."""
    starts = list(PORTS)[: len(PORTS) - count + 1]
    random.shuffle(starts)
    for start in starts:
        socks: list[socket.socket] = []
        try:
            for port in range(start, start + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} free consecutive ports in {PORTS.start}-{PORTS.stop - 1}")


def option(cmdline: list[str], flag: str) -> str | None:
    """The value after `flag` in a command line."""
    try:
        return cmdline[cmdline.index(flag) + 1]
    except (ValueError, IndexError):
        return None


def cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# --- one request -----------------------------------------------------------------------------


@dataclass
class Outcome:
    """One streaming request as the client saw it."""

    kind: str  # ok, dropped, timeout, http <status>, error, incomplete
    detail: str = ""
    chunks: int = 0
    deployment: str = ""
    job: str = ""
    started: float = 0.0
    ended: float = 0.0
    client_port: int = 0  # the local port of its connection: which server process held it
    last_chunk: float = 0.0  # monotonic time of the newest content chunk (0: none)
    max_gap: float = 0.0  # the longest wait between two content chunks, in seconds

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def stream_chat(
    url: str,
    api_key: str,
    model: str,
    *,
    max_tokens: int = MAX_TOKENS,
    on_chunk: Callable[[int], None] | None = None,
    deadline: float = REQUEST_DEADLINE,
) -> Outcome:
    """One streamed chat completion on a connection of its own. Complete means: content, a
    finish_reason, the final usage chunk and [DONE], with no error event."""
    out = Outcome(kind="incomplete", started=time.monotonic())
    end_by = out.started + deadline
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] | None = None
    finish: str | None = None
    done = False
    error = ""

    def trace(event: str, info: dict[str, Any]) -> None:
        # The connection's local port, known before the request is sent: a request that fails
        # before any response still says which server process had accepted it.
        if event == "connection.connect_tcp.complete":
            addr = info["return_value"].get_extra_info("client_addr")
            out.client_port = int(addr[1]) if addr else 0

    try:
        with httpx.Client(timeout=httpx.Timeout(STREAM_GAP, connect=10.0)) as client:
            with client.stream(
                "POST",
                f"{url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {api_key}"},
                json=body,
                extensions={"trace": trace},
            ) as resp:
                out.deployment = resp.headers.get("X-Racon-Deployment-Id", "")
                out.job = resp.headers.get("X-Racon-Job-Id", "")
                if resp.status_code != 200:
                    resp.read()
                    out.kind, out.detail = f"http {resp.status_code}", resp.text[:200]
                    return out
                for line in resp.iter_lines():
                    if time.monotonic() > end_by:
                        out.kind, out.detail = "timeout", f"still streaming after {deadline:.0f}s"
                        return out
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        error = str(obj["error"].get("message"))
                        continue
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            now = time.monotonic()
                            if out.last_chunk:
                                out.max_gap = max(out.max_gap, now - out.last_chunk)
                            out.last_chunk = now
                            out.chunks += 1
                            if on_chunk is not None:
                                on_chunk(out.chunks)
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
    except httpx.TimeoutException as exc:
        out.kind, out.detail = "timeout", repr(exc)[:200]
        return out
    except httpx.TransportError as exc:
        out.kind, out.detail = "dropped", repr(exc)[:200]
        return out
    finally:
        out.ended = time.monotonic()
    if error:
        out.kind, out.detail = "error", error[:200]
    elif done and finish and usage and int(usage.get("completion_tokens") or 0) > 0:
        out.kind = "ok"
    else:
        out.detail = f"done={done} finish={finish} usage={usage}"
    return out


# --- the cluster -----------------------------------------------------------------------------


@dataclass
class Cluster:
    launcher: Launcher
    model: str
    api_key: str
    env: dict[str, str]  # the launcher's environment plus its secrets: for manage.py
    notes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.launcher.url

    def get(self, path: str, timeout: float = 10.0) -> Any:
        resp = httpx.get(
            self.url + path, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=timeout
        )
        resp.raise_for_status()
        return resp.json()

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(
            self.url + path,
            headers={"Authorization": f"Bearer {self.api_key}"},
            json=body,
            timeout=30,
        )

    def deployments(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get(f"/api/admin/deployments?model={self.model}")
        return found

    def serving(self) -> list[dict[str, Any]]:
        """READY replicas, one per node (the first of each)."""
        seen: dict[str, dict[str, Any]] = {}
        for d in self.deployments():
            if d["state"] in SERVING and d["primary"] and d["primary"] not in seen:
                seen[d["primary"]] = d
        return list(seen.values())

    def ready_nodes(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get("/api/admin/nodes?state=READY")
        return found

    def stream(self, **kw: Any) -> Outcome:
        return stream_chat(self.url, self.api_key, self.model, **kw)

    # --- processes -----------------------------------------------------------------------------

    def agents(self) -> dict[str, psutil.Process]:
        """The node-agent processes (the launcher's children) by node name."""
        out: dict[str, psutil.Process] = {}
        try:
            kids = psutil.Process(self.launcher.proc.pid).children()
        except psutil.NoSuchProcess:
            return out
        self.launcher.descendants()
        for p in alive(kids):
            cl = cmdline(p)
            if is_agent(cl):
                out[option(cl, "--node-name") or str(p.pid)] = p
        return out

    def agent_children(self, match: Callable[[list[str]], bool]) -> list[psutil.Process]:
        found = []
        for agent in self.agents().values():
            try:
                kids = agent.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            found += [p for p in alive(kids) if match(cmdline(p))]
        return found

    def primary_process(self, deployment_id: str) -> psutil.Process | None:
        """The llama-server of that deployment (its --alias is the deployment id)."""
        for p in self.agent_children(lambda cl: bool(cl) and cl[0].endswith("llama-server")):
            if option(cmdline(p), "--alias") == deployment_id:
                return p
        return None

    # --- settling ------------------------------------------------------------------------------

    def open_jobs(self, since: datetime) -> int | None:
        """Jobs queued since then and not terminal (QUEUED, DISPATCHED, RUNNING), or None while
        the API does not answer."""
        after = quote(since.isoformat())
        try:
            return sum(
                len(self.get(f"/api/admin/jobs?state={s}&since={after}&limit=1000"))
                for s in OPEN_JOB_STATES
            )
        except (httpx.HTTPError, ValueError):
            return None

    def held(self) -> int | None:
        """The operator account's credits held for jobs not settled yet."""
        try:
            return int(self.get("/api/credits/balance")["held"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def credits_check(self) -> tuple[int, str]:
        """`manage.py credits_check --json` against the cluster's database: (violations, text)."""
        proc = subprocess.run(
            [sys.executable, "manage.py", "credits_check", "--json"],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        start = proc.stdout.find("{")
        if start < 0:
            raise AssertionError(
                f"credits_check printed no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        report = json.loads(proc.stdout[start:])
        violations = (
            len(report["unbalanced_entries"])
            + len(report["balance_mismatches"])
            + len(report["below_floor"])
            + (1 if report["holds_mismatch"] else 0)
        )
        assert (violations == 0) == bool(report["ok"]), report
        return violations, proc.stdout[start:] + proc.stderr

    def wait_replicas(self, *, timeout: float = 150.0) -> list[dict[str, Any]]:
        """Two READY replicas on two READY nodes, each with its llama-server running, both agents
        up and /health 200. What the test does meanwhile, as an operator would, and notes (the
        cluster does neither itself today):
        - a READY deployment whose llama-server is gone for GHOST_GRACE s is stopped;
        - with fewer than two replicas active (placed, loading or serving) for REDEPLOY_AFTER s,
          one more is deployed."""
        deadline = time.monotonic() + timeout
        short_since: float | None = None
        ghost_since: dict[str, float] = {}
        last: Any = None
        while time.monotonic() < deadline:
            now = time.monotonic()
            try:
                nodes = {n["id"] for n in self.ready_nodes()}
                deps = self.deployments()
                live = []
                for d in deps:
                    if d["state"] not in SERVING:
                        continue
                    if self.primary_process(d["id"]) is not None:
                        live.append(d)
                        ghost_since.pop(d["id"], None)
                    elif now - ghost_since.setdefault(d["id"], now) >= GHOST_GRACE:
                        resp = self.post(f"/api/admin/deployments/{d['id']}/stop", None)
                        self.notes.append(
                            f"stopped READY deployment {d['id'][:8]} on {d['primary_name']}: "
                            f"{GHOST_NOTE} {GHOST_GRACE:.0f} s ({resp.status_code})"
                        )
                        ghost_since.pop(d["id"], None)
                primaries = {d["primary"] for d in live}
                if (
                    len(primaries) >= 2
                    and primaries <= nodes
                    and len(self.agents()) == 2
                    and self.launcher.health() == 200
                ):
                    return live
                active = [d for d in deps if d["state"] in ACTIVE and d["id"] not in ghost_since]
                last = [(d["state"], d.get("primary_name"), d["id"][:8]) for d in deps][:6]
                if len(active) >= 2 or len(nodes) < 2:
                    short_since = None
                elif short_since is None:
                    short_since = now
                elif now - short_since >= REDEPLOY_AFTER:
                    resp = self.post("/api/admin/deployments", {"model": self.model})
                    self.notes.append(
                        f"deployed a replica to replace the lost one ({resp.status_code})"
                    )
                    short_since = None
            except (httpx.HTTPError, ValueError) as exc:
                last = repr(exc)
            time.sleep(1.0)
        raise AssertionError(
            f"two READY replicas did not come back within {timeout:.0f}s (last: {last!r})\n"
            f"{self.launcher.log()[-3000:]}"
        )


def cluster_env(var: Path, port: int, rpc_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
    env.update(
        RACON_VAR_DIR=str(var),
        RACON_MODEL_STORE=str(var / "store"),
        PORT=str(port),
        RACON_RPC_PORT=str(rpc_port),
        DAPHNE_PROCESSES="2",  # as `make run` on 2 cores: killing one leaves the other serving
        PYTHONUNBUFFERED="1",
        SPEED_CHALLENGE="false",
        STREAM_IDLE_TIMEOUT_SECONDS=str(STREAM_IDLE_TIMEOUT),
        REPLICA_MAX_PER_MODEL="2",
        LOG_FORMAT="text",
        # Every event in the launcher's log: a lost request's report quotes its job's lines.
        LOG_LEVEL="INFO",
    )
    # Failures seen in seconds, not minutes (the defaults are 5 s heartbeats, 9 missed), with
    # windows that hold on a busy machine.
    env.update(timing.heartbeat_env())
    return env


def start_cluster(var: Path) -> tuple[Launcher, dict[str, str]]:
    """`python -m racon.launcher --agents 2` with SmolLM2 in its model store; not waited for."""
    store = var / "store"
    store.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_path()
    (store / gguf.name).unlink(missing_ok=True)
    (store / gguf.name).symlink_to(gguf)  # bootstrap registers the store's first GGUF
    port = take_port()
    rpc_port = take_port(count=2)  # the launcher gives agent i RACON_RPC_PORT + i
    env = cluster_env(var, port, rpc_port)
    log_path = var.parent / f"launcher-{port}.log"
    log = open(log_path, "wb")  # closed by Launcher.close
    proc = subprocess.Popen(
        [sys.executable, "-m", "racon.launcher", "--agents", "2"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return Launcher(var=var, port=port, log_path=log_path, proc=proc, _log=log), env


def stop_cluster(la: Launcher) -> None:
    """Everything the launcher ever started is gone afterwards, whatever state it was left in:
    SIGTERM (it stops its children), then SIGKILL to its group, to each child seen, and to any
    process still naming the cluster's var dir (llama-server, rpc workers, beat)."""
    la.descendants()
    try:
        if la.proc.poll() is None:
            la.proc.send_signal(signal.SIGTERM)
            try:
                la.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            os.killpg(la.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        la.close()  # kills every child it saw, closes the log
        var = str(la.var)
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.pid != os.getpid() and any(var in part for part in (p.info["cmdline"] or [])):
                    p.kill()
            except psutil.Error:
                pass


# --- one scenario ----------------------------------------------------------------------------


def fmt(seconds: float | None) -> str:
    return f"{seconds:.1f} s" if seconds is not None else "never"


@dataclass
class Result:
    scenario: str
    sent: int = 0
    lost: int = 0
    lost_by_design: int = 0
    stuck_jobs: int | None = None
    violations: int | None = None
    holds_open: int | None = None  # micro-credits still held for this scenario's jobs
    recover_s: float | None = None
    settle_s: float | None = None
    replicas_s: float | None = None  # from the settled cluster to two READY replicas again
    note: str = ""
    failures: dict[str, int] = field(default_factory=dict)
    failed: list[Outcome] = field(default_factory=list)  # every request that was not ok

    def line(self) -> str:
        if self.note.startswith("skipped"):
            return f"[reliability] {self.scenario}: {self.note}"
        rec = fmt(self.recover_s)
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.failures.items())) or "none"
        return (
            f"[reliability] {self.scenario}: sent {self.sent}, lost {self.lost}"
            f" (by design {self.lost_by_design}; {kinds}), stuck jobs {self.stuck_jobs},"
            f" ledger violations {self.violations}, credits still held {self.holds_open} µcr,"
            f" recovered in {rec}, settled in {self.settle_s:.1f} s,"
            f" two replicas again in {fmt(self.replicas_s)}{'; ' + self.note if self.note else ''}"
        )


def run_scenario(
    cluster: Cluster,
    name: str,
    kill: Callable[[], str],
    *,
    by_design: Callable[[Outcome], bool] = lambda o: False,
) -> Result:
    """8 clients, 2 requests each; `kill` runs once at least 3 streams are mid-stream and returns
    what it killed. Then: a retry loop until one request succeeds, the clients' outcomes, and a
    bounded wait for no open job and no held credit, then the ledger check."""
    cluster.wait_replicas()
    result = Result(scenario=name)
    # This scenario's jobs and holds only: one that failed before leaves its own behind.
    since = datetime.now(UTC) - timedelta(seconds=1)
    held_before = cluster.held() or 0
    lock = threading.Lock()
    mid_stream: dict[int, int] = {}
    outcomes: list[Outcome] = []
    triggered = threading.Event()

    def client(i: int) -> None:
        for _ in range(REQUESTS_PER_STREAM):

            def seen(n: int, i: int = i) -> None:
                with lock:
                    mid_stream[i] = n
                    if sum(1 for c in mid_stream.values() if c >= 3) >= 3:
                        triggered.set()

            out = cluster.stream(on_chunk=seen)
            with lock:
                mid_stream.pop(i, None)
                outcomes.append(out)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    mid = triggered.wait(timeout=60)
    killed = kill()
    t_kill = time.monotonic()
    if not mid:
        result.note = "killed after 60 s without 3 streams mid-stream"

    # The retry: a new request after the kill, again every 0.5 s until one succeeds.
    attempts = 0
    while time.monotonic() - t_kill < RECOVER_DEADLINE:
        attempts += 1
        probe = cluster.stream(max_tokens=8, deadline=30.0)
        if probe.ok:
            result.recover_s = probe.ended - t_kill
            break
        time.sleep(0.5)
    for t in threads:
        t.join(timeout=REQUEST_DEADLINE * REQUESTS_PER_STREAM + 10)
    assert not any(t.is_alive() for t in threads), "a client outlived its deadline"

    result.sent = len(outcomes)
    for o in outcomes:
        if o.ok:
            continue
        result.failed.append(o)
        result.failures[o.kind] = result.failures.get(o.kind, 0) + 1
        if by_design(o):
            result.lost_by_design += 1
        else:
            result.lost += 1

    # Settle: no job left open and no credit held, within the stale sweep's reach.
    t_settle = time.monotonic()
    stuck: int | None = None
    holds: int | None = None
    while time.monotonic() - t_settle < SETTLE_DEADLINE:
        stuck, held = cluster.open_jobs(since), cluster.held()
        holds = None if held is None else max(0, held - held_before)
        if stuck == 0 and holds == 0:
            break
        time.sleep(1.0)
    result.settle_s = time.monotonic() - t_settle
    result.stuck_jobs, result.holds_open = stuck, holds
    result.violations, _ = cluster.credits_check()
    t_replicas = time.monotonic()
    try:
        cluster.wait_replicas()
        result.replicas_s = time.monotonic() - t_replicas
    except AssertionError as exc:
        cluster.notes.append(str(exc).splitlines()[0])
    details = [f"killed {killed}", f"{attempts} retries"]
    bad = [o for o in outcomes if not o.ok][:2]
    details += [
        (
            f"{o.kind} (job {o.job[:8] or '?'}, {o.chunks} chunks, {o.ended - o.started:.1f} s, "
            f"last chunk at {(o.last_chunk - o.started) if o.last_chunk else 0:.1f} s, "
            f"longest gap {o.max_gap:.1f} s): "
            f"{' '.join(o.detail.split())[:120]}"
        )
        for o in bad
    ]
    result.note = "; ".join([*([result.note] if result.note else []), *details, *cluster.notes])
    cluster.notes.clear()
    return result


def client_ports(p: psutil.Process, server_port: int) -> set[int]:
    """The client ports of the connections `p` holds on `server_port` (accepted, not closed)."""
    try:
        conns = p.net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.raddr.port for c in conns if c.raddr and c.laddr.port == server_port}


def wait_gone(p: psutil.Process, timeout: float = 30.0) -> None:
    wait_for(lambda: not alive([p]), timeout, f"pid {p.pid} to be gone")


def table(results: list[Result]) -> str:
    """The summary: one row per scenario, the figures of its printed line, then the notes."""
    head = (
        "scenario",
        "sent",
        "lost",
        "by design",
        "stuck jobs",
        "ledger viol.",
        "held (µcr)",
        "recover s",
        "settle s",
        "replicas s",
    )
    rows: list[tuple[str, ...]] = [head]
    for r in results:
        if r.note.startswith("skipped"):
            rows.append((r.scenario, *["-"] * (len(head) - 1)))
            continue
        secs = [
            f"{v:.1f}" if v is not None else "never"
            for v in (r.recover_s, r.settle_s, r.replicas_s)
        ]
        rows.append((
            r.scenario, str(r.sent), str(r.lost), str(r.lost_by_design), str(r.stuck_jobs),
            str(r.violations), str(r.holds_open), *secs,
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines += [f"{r.scenario}: {r.note}" for r in results if r.note]
    return "\n".join(lines) + "\n"
