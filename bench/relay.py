"""Relay benchmark: what RACoN's token relay costs per token, measured on its own.

Run: ``python bench/relay.py [--levels 1,16,64,256] [--quick] [--idle-seconds 30]``.

A synthetic engine stands in for llama-server: this file, run with ``--engine``, is a fake
``llama-server`` (``/health``, ``/props``, ``/apply-template``, ``/detokenize`` and a streamed
``/completion`` in llama-server's own SSE format, chunked like cpp-httplib writes it, with
``return_tokens``) that emits tokens as fast as its socket takes them. The agent supervises it as
it would the real one (``RACON_LLAMA_SERVER`` points at a two-line wrapper), so the agent's SSE
parsing and Redis writes are measured too. Everything else is real: the ``node-agent``, its own
Redis (the embedded ``redis-server``, so no other session's traffic is counted), and the
controller as the test live cluster starts it (daphne + a Celery worker with beat,
tests/e2e/harness.run_controller, production heartbeat timings). Clients are asyncio streaming
``/v1/completions`` requests on raw sockets (cheap, so they steal little CPU from what is
measured); after each level every answer is parsed and checked: the text and the usage's token
count must be exactly what the engine emitted.

Slots and queue for the bench: the largest level (256) is served by replicas of 64 slots (the
deployment API's bound on ``n_parallel``; 4 fake engines under the one agent, placed with
``allow_same_node``) at a per-slot context of ``--n-ctx`` (2560): a request's tokens fit its
slot, a level is several rounds of requests when ``--tokens`` asks for more, and every stream gets
at least one request that fills its slot, so that the requests' own work does not drown the relay's
share at 64 and 256 streams), and the controller runs with ``JOB_QUEUE_MAX`` = 4 ×
that, so no request waits for a slot or is refused: the relay alone is measured.

Printed, per level (1, 16, 64, 256 streams): relayed tokens/s, CPU-microseconds per relayed token
in each process (agent, Redis, daphne, Celery with its children; psutil cpu_times deltas per pid
over the level), twice: 'all' (every CPU-us of the level over its tokens) and 'relay' (less what
the same requests cost with one token each: admission, the job's rows, settlement), the relay's
tokens/s per core of relay CPU (goal >= 20,000), and the added
time per token: the latency from the engine's write to the client's read of each token, measured
at one stream with the engine paced (``--paced-tps``) and each token's text carrying the engine's
CLOCK_MONOTONIC time. Then the idle CPU of the whole stack over ``--idle-seconds`` (goal <= 2 % of
one core). The machine is shared: the load average is printed with the figures.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

# --- the synthetic engine (kept import-light: it starts once per deployment load) ---------------

WORDS = [f" w{i}" for i in range(50)]  # each token's text; ids 1000 + i


def _engine_main(argv: list[str]) -> int:
    """A fake llama-server: ``--port``, ``-np`` and the rest of llama-server's flags (ignored)."""
    port = int(argv[argv.index("--port") + 1])
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1024)
    print(f"fake llama-server listening on 127.0.0.1:{port}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_engine_conn, args=(conn,), daemon=True).start()


def _read_request(f: Any) -> tuple[str, str, dict[str, Any]] | None:
    line = f.readline()
    if not line:
        return None
    method, path, _ = line.decode().split(" ", 2)
    length = 0
    while True:
        h = f.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = json.loads(f.read(length)) if length else {}
    return method, path, body


def _reply(conn: socket.socket, obj: Any, status: str = "200 OK") -> None:
    data = json.dumps(obj).encode()
    conn.sendall(
        b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )


def _frame(event: bytes) -> bytes:
    payload = b"data: " + event + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _engine_conn(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = conn.makefile("rb")
    try:
        while True:
            req = _read_request(f)
            if req is None:
                return
            method, path, body = req
            if path.startswith("/health"):
                _reply(conn, {"status": "ok"})
            elif path.startswith("/props"):
                _reply(conn, {"default_generation_settings": {}, "total_slots": 1})
            elif path.startswith("/apply-template"):
                msgs = body.get("messages") or []
                _reply(conn, {"prompt": "".join(str(m.get("content") or "") for m in msgs)})
            elif path.startswith("/detokenize"):
                toks = body.get("tokens") or []
                _reply(conn, {"content": "".join(WORDS[(t - 1000) % 50] for t in toks)})
            elif path.startswith("/completion"):
                _stream(conn, body)
                return
            else:
                _reply(conn, {"error": {"code": 404, "message": "not found"}}, "404 Not Found")
    except (OSError, ValueError):
        return
    finally:
        conn.close()


def _stream(conn: socket.socket, body: dict[str, Any]) -> None:
    n = int(body.get("n_predict") or 16)
    n = 16 if n < 0 else n
    # A prompt "PACED <tokens/s> ..." asks for that pace (the latency part of the bench).
    m = re.match(r"PACED (\d+(?:\.\d+)?)", str(body.get("prompt") or ""))
    paced = float(m.group(1)) if m else 0.0
    if not body.get("stream"):
        text = "".join(WORDS[i % 50] for i in range(n))
        _reply(conn, {"content": text, "tokens": [], "stop": True, "stop_type": "limit"})
        return
    prompt = body.get("prompt")
    n_prompt = len(str(prompt)) // 4 + 1
    slot = int(body.get("id_slot", -1))
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    t0 = time.monotonic()
    batch: list[bytes] = []
    for i in range(n):
        if paced:
            # The text carries the write time (ns, CLOCK_MONOTONIC): the client measures the
            # relay's added latency per token from it.
            wait = t0 + i / paced - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            text = f" t{time.monotonic_ns()}"
            tok = 1000 + i % 50
        else:
            text, tok = WORDS[i % 50], 1000 + i % 50
        batch.append(
            _frame(
                b'{"index":0,"content":%s,"tokens":[%d],"stop":false,"id_slot":%d,'
                b'"tokens_predicted":%d,"tokens_evaluated":%d}'
                % (json.dumps(text).encode(), tok, slot, i + 1, n_prompt)
            )
        )
        # Flush at once when paced; else a few events a write (a decode step's worth).
        if paced or len(batch) >= 8:
            conn.sendall(b"".join(batch))
            batch.clear()
    took = max(1e-6, time.monotonic() - t0)
    final = {
        "index": 0, "content": "", "tokens": [], "id_slot": max(slot, 0), "stop": True,
        "model": "fake", "tokens_predicted": n, "tokens_evaluated": n_prompt,
        "generation_settings": {"n_predict": n, "temperature": body.get("temperature")},
        "prompt": "", "has_new_line": False, "truncated": False, "stop_type": "limit",
        "stopping_word": "", "tokens_cached": n_prompt + n,
        "timings": {"cache_n": 0, "prompt_n": n_prompt, "prompt_ms": 0.1,
                    "predicted_n": n, "predicted_ms": took * 1000,
                    "predicted_per_second": n / took},
    }  # fmt: skip
    batch.append(_frame(json.dumps(final).encode()))
    batch.append(b"0\r\n\r\n")
    conn.sendall(b"".join(batch))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--engine":
    sys.exit(_engine_main(sys.argv[2:]))


# --- the benchmark ------------------------------------------------------------------------------

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:  # imported in main, once the environment is set
    from bench.common import CpuMeter

GOAL_TOKENS_PER_CORE = 20_000
GOAL_IDLE_CORE = 0.02
MAX_SLOTS_PER_DEPLOYMENT = 64  # the deployment API's bound on n_parallel
_TS = re.compile(rb" t(\d{6,})")


@dataclass
class Stream:
    ttft: float = 0.0
    wall: float = 0.0
    raw: bytes = b""
    delays_ns: list[int] = field(default_factory=list)
    error: str = ""


def _dechunk(raw: bytes) -> bytes:
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return body
    out, i = [], 0
    while i < len(body):
        j = body.find(b"\r\n", i)
        if j < 0:
            break
        size = int(body[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(body[j + 2 : j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)


def parse_answer(raw: bytes) -> tuple[str, int, list[str], int]:
    """(text, usage completion_tokens, finish reasons, SSE chunks) of one streamed answer."""
    status = raw.split(b"\r\n", 1)[0]
    if b" 200 " not in status:
        raise RuntimeError(f"{status.decode(errors='replace')}: {raw[-300:]!r}")
    text, usage, finishes, chunks = [], -1, [], 0
    for block in _dechunk(raw).split(b"\n\n"):
        if not block.startswith(b"data: ") or block == b"data: [DONE]":
            continue
        obj = json.loads(block[6:])
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        chunks += 1
        for c in obj.get("choices") or []:
            text.append(c.get("text") or "")
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
        if obj.get("usage"):
            usage = int(obj["usage"]["completion_tokens"])
    return "".join(text), usage, finishes, chunks


async def one_stream(
    host: str, port: int, key: str, model: str, max_tokens: int, paced: float, i: int
) -> Stream:
    s = Stream()
    prompt = f"PACED {paced:g} request {i}." if paced else f"Relay bench request {i}."
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
    ).encode()
    req = (
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (host.encode(), key.encode(), len(body), body)
    )
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(req)
        parts: list[bytes] = []
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if not s.ttft and (b'"text": "' in data or b'"text":"' in data):
                s.ttft = time.perf_counter() - t0
            if paced:
                now = time.monotonic_ns()
                s.delays_ns += [now - int(m) for m in _TS.findall(data)]
            parts.append(data)
        writer.close()
        s.raw = b"".join(parts)
    except OSError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.wall = time.perf_counter() - t0
    return s


async def run_level(
    url: str, key: str, model: str, *, streams: int, max_tokens: int, paced: float = 0.0
) -> tuple[list[Stream], float]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    t0 = time.perf_counter()
    got = await asyncio.gather(
        *(
            one_stream(u.hostname or "127.0.0.1", u.port or 80, key, model, max_tokens, paced, i)
            for i in range(streams)
        )
    )
    return list(got), time.perf_counter() - t0


def start_profiles(meter: CpuMeter, workdir: Path) -> list[tuple[str, Any, Path]]:
    """One ``py-spy record`` per process (Celery: per child), stopped by report_profiles. Only
    samples holding the GIL (``--gil``): Python's CPU, not threads waiting on a socket."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spies = []
    for name, procs in meter.ps.items():
        if name == "redis":
            continue
        for p in procs:
            for q in [p] + (p.children(recursive=True) if name in meter.children else []):
                out = workdir / f"profile-{name}-{q.pid}.txt"
                proc = subprocess.Popen(
                    [exe, "record", "--pid", str(q.pid), "--format", "raw", "-r", "200", "--gil",
                     "-o", str(out), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                spies.append((f"{name}:{q.pid}", proc, out))
    time.sleep(1.0)  # attached
    return spies


def report_profiles(spies: list[tuple[str, Any, Path]], top: int = 12) -> None:
    """Each process's top costs: self time by function, and inclusive time of the project's own
    functions, as shares of its samples."""
    import signal
    from collections import Counter

    for _, proc, _ in spies:
        proc.send_signal(signal.SIGINT)
    for _, proc, _ in spies:
        try:
            proc.wait(30)
        except Exception:  # a stuck profiler is killed, never waited on
            proc.kill()
    for name, _, out in spies:
        if not out.exists():
            print(f"  profile {name}: none written")
            continue
        own: Counter[str] = Counter()
        incl: Counter[str] = Counter()
        total = 0
        for line in out.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[_short(frames[-1])] += n
            for f in {_short(f) for f in frames if " (agent/" in f or " (apps/" in f}:
                incl[f] += n
        if total < 20:
            continue
        print(f"  profile {name}: {total} samples")
        print(
            "    self:      "
            + "; ".join(f"{f} {100 * n / total:.0f}%" for f, n in own.most_common(top))
        )
        print(
            "    inclusive: "
            + "; ".join(f"{f} {100 * n / total:.0f}%" for f, n in incl.most_common(top))
        )


def _short(frame: str) -> str:
    """py-spy's ``func (path:line)`` as ``func (file)``."""
    func, _, where = frame.partition(" (")
    path = where.split(":")[0]
    parts = path.split("/")
    return f"{func} ({'/'.join(parts[-2:])})"


def expected_text(n: int) -> str:
    return "".join(WORDS[i % 50] for i in range(n))


def check(streams: list[Stream], max_tokens: int) -> tuple[int, int, list[str]]:
    """(tokens relayed, SSE content chunks, problems): text and count must be exact."""
    want = expected_text(max_tokens)
    tokens = chunks = 0
    problems: list[str] = []
    for s in streams:
        if s.error:
            problems.append(s.error)
            continue
        try:
            text, usage, finishes, n_chunks = parse_answer(s.raw)
        except (RuntimeError, ValueError) as exc:
            problems.append(str(exc)[:300])
            continue
        if text != want or usage != max_tokens or finishes != ["length"]:
            problems.append(
                f"inexact: {len(text)} chars (want {len(want)}), usage {usage} (want "
                f"{max_tokens}), finish {finishes}"
            )
        tokens += usage if usage > 0 else 0
        chunks += n_chunks
    return tokens, chunks, problems


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--levels", default="1,16,64,256")
    p.add_argument(
        "--tokens", type=int, default=32768, help="tokens per level (split over streams)"
    )
    p.add_argument(
        "--n-ctx",
        type=int,
        default=2560,
        help="per-slot context of the deployment; each stream's requests fill it",
    )
    p.add_argument(
        "--paced-tps", type=float, default=100.0, help="engine pace for the latency part"
    )
    p.add_argument("--paced-tokens", type=int, default=200)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--quick", action="store_true", help="a quarter of the tokens, 15 s idle")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="py-spy each process during this level (needs py-spy: pip install py-spy)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, profiles)")
    p.add_argument("--label", default="", help="printed in the header (e.g. baseline, after)")
    args = p.parse_args()
    if args.quick:
        args.tokens //= 4
        args.idle_seconds = min(args.idle_seconds, 15.0)
    levels = [int(x) for x in args.levels.split(",")]
    slots = max(levels)

    workdir = Path(__import__("tempfile").mkdtemp(prefix="racon-relay-"))
    wrapper = workdir / "fake-llama-server"
    wrapper.write_text(
        f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --engine "$@"\n'
    )
    wrapper.chmod(0o755)
    # The agent's RPC worker is the real one of this build (found beside the real llama-server).
    from agent.runtime.server import find_llama_server

    os.environ.setdefault("RACON_RPC_SERVER", str(find_llama_server().parent / "ggml-rpc-server"))
    os.environ["RACON_LLAMA_SERVER"] = str(wrapper)
    os.environ.pop("REDIS_URL", None)  # the embedded Redis: only this bench's traffic is counted
    os.environ["JOB_QUEUE_MAX"] = str(4 * slots)
    os.environ["DEFAULT_N_PARALLEL_MAX"] = str(slots)
    os.environ.setdefault("LOG_LEVEL", "WARNING")

    from bench.common import MODEL_NAME, CpuMeter, load_average, local_cluster

    print(
        f"== relay{' (' + args.label + ')' if args.label else ''}: synthetic engine -> agent -> "
        f"Redis -> daphne -> {levels} streaming clients; {load_average()} ==",
        flush=True,
    )
    with local_cluster(1, workdir=workdir, benchmark=False, cores=2, log=print) as cl:
        per_dep = min(slots, MAX_SLOTS_PER_DEPLOYMENT)
        deps = [
            cl.deploy(
                [cl.node_names[0]], n_ctx=args.n_ctx, n_parallel=per_dep, allow_same_node=k > 0
            )
            for k in range(-(-slots // per_dep))
        ]
        print(
            f"  {len(deps)} replica(s) on the one agent, {per_dep} slots x {args.n_ctx} ctx each "
            "(fake engines)"
        )
        agent = cl.agents[0].proc.pid
        redis_pid = cl.env.embedded.process.pid
        assert cl.ctl.worker is not None
        daphnes, celery = [p.pid for p in cl.ctl.procs], cl.ctl.worker.pid
        meter = CpuMeter(
            {"agent": [agent], "redis": [redis_pid], "daphne": daphnes, "celery": [celery]},
            children={"celery"},
        )
        key, url = cl.ctl.api_key, cl.ctl.url
        asyncio.run(run_level(url, key, MODEL_NAME, streams=2, max_tokens=32))  # warm
        # Idle: the whole stack with its deployments loaded and nothing to serve.
        time.sleep(10.0)  # the warm-up's settlement and events are done
        before = meter.read()
        t0 = time.monotonic()
        time.sleep(args.idle_seconds)
        after = meter.read()
        span = time.monotonic() - t0
        idle = {k: (after[k] - before[k]) / span for k in before}
        total = sum(idle.values())
        print(
            f"  idle CPU over {span:.0f} s (beat, sweeps, heartbeats; one READY node, "
            f"{len(deps)} loaded deployments): {total * 100:.2f} % of one core ("
            + ", ".join(f"{k} {v * 100:.2f} %" for k, v in idle.items())
            + f") [goal <= {GOAL_IDLE_CORE * 100:.0f} %] "
            + ("PASS" if total <= GOAL_IDLE_CORE else "FAIL")
        )
        print(
            "  per level: 'all' = every CPU-us of the level over its tokens; 'relay' = the same "
            "less what the level's requests cost with one token each (per-request work)"
        )
        header = (
            f"{'streams':>7} {'tok/s':>8} {'SSE chunks/tok':>14} | us/token     "
            f"{'agent':>7} {'redis':>7} {'daphne':>7} {'celery':>7} {'total':>7} | "
            f"{'tok/s per relay core':>20}"
        )
        print(header)
        for streams in levels:
            # Every stream's request at least as long as a slot holds: with short requests their
            # own work (admission, rows, settlement) is most of a wide level's CPU and the relay's
            # share is lost in its noise (UNMEASURED at 64 and 256 streams with 512-token slots).
            level_tokens = max(args.tokens, streams * (args.n_ctx - 16))
            max_tokens = max(16, min(level_tokens // streams, args.n_ctx - 16))
            # One slot's context bounds a request's tokens: several rounds make up the level.
            rounds = max(1, level_tokens // (streams * max_tokens))
            spies = start_profiles(meter, workdir) if streams == args.profile else []
            before = meter.read()
            t_total = 0.0
            tokens = chunks = 0
            problems: list[str] = []
            for _ in range(rounds):
                got, wall = asyncio.run(
                    run_level(url, key, MODEL_NAME, streams=streams, max_tokens=max_tokens)
                )
                t_total += wall
                tk, ch, pr = check(got, max_tokens)
                tokens, chunks, problems = tokens + tk, chunks + ch, problems + pr
            after = meter.read()
            if spies:
                report_profiles(spies)
            cpu = {k: after[k] - before[k] for k in before}
            # The same requests with one token each: what a request costs apart from its tokens
            # (admission, the job's rows, dispatch, settlement), taken off to leave the relay's.
            before = meter.read()
            for _ in range(rounds):
                asyncio.run(run_level(url, key, MODEL_NAME, streams=streams, max_tokens=1))
            after = meter.read()
            req = {k: after[k] - before[k] for k in before}
            n_req = streams * rounds
            per_req = {k: 1e3 * v / max(1, n_req) for k, v in req.items()}
            rows = {
                "all": {k: 1e6 * v / max(1, tokens) for k, v in cpu.items()},
                "relay": {
                    k: max(0.0, 1e6 * (cpu[k] - req[k]) / max(1, tokens - streams * rounds))
                    for k in cpu
                },
            }
            # The subtraction measures nothing where the requests' own work is (nearly) all of
            # the level's CPU: few tokens per request (256 streams, --quick) on a noisy machine.
            left = sum(cpu.values()) - sum(req.values())
            unmeasured = left <= 0.1 * sum(cpu.values())
            for label, per in rows.items():
                total_us = sum(per.values())
                rate = 1e6 / max(total_us, 1e-9)
                head = (
                    f"{streams:>7} {tokens / t_total:>8.0f} {chunks / max(1, tokens):>14.3f}"
                    if label == "all"
                    else f"{'':>7} {'':>8} {'':>14}"
                )
                verdict = (
                    f"[goal >= {GOAL_TOKENS_PER_CORE}] "
                    f"{'PASS' if rate >= GOAL_TOKENS_PER_CORE else 'FAIL'}"
                    if label == "relay"
                    else ""
                )
                if label == "relay" and unmeasured:
                    verdict = (
                        "UNMEASURED: the requests' own work (one token each) is "
                        f"{100 * sum(req.values()) / max(1e-9, sum(cpu.values())):.0f} % of the "
                        "level's CPU, so the relay's share is lost in its noise (more tokens per "
                        "request, --tokens and --n-ctx, measure it)"
                    )
                    rate = float("nan")
                print(
                    f"{head} | {label:>12} {per['agent']:>7.1f} {per['redis']:>7.1f} "
                    f"{per['daphne']:>7.1f} {per['celery']:>7.1f} {total_us:>7.1f} | "
                    f"{rate:>12.0f} {verdict}"
                    + (
                        f"  PROBLEMS {len(problems)}: {problems[:2]}"
                        if problems and label == "all"
                        else ""
                    ),
                    flush=True,
                )
            print(
                f"{'':>7} {'':>8} {'':>14} | {'ms/request':>12} "
                f"{per_req['agent']:>7.2f} {per_req['redis']:>7.2f} {per_req['daphne']:>7.2f} "
                f"{per_req['celery']:>7.2f} {sum(per_req.values()):>7.2f} | CPU per request "
                f"({n_req} one-token requests: admission, job rows, dispatch, finish, settlement)",
                flush=True,
            )
        # Added time per token: one stream, the engine paced, each token stamped with its
        # write time; the client's read time minus that is the relay's latency for the token.
        got, _ = asyncio.run(
            run_level(
                url, key, MODEL_NAME, streams=1, max_tokens=args.paced_tokens, paced=args.paced_tps
            )
        )
        delays = [d / 1e6 for s in got for d in s.delays_ns]
        if delays and not got[0].error:
            q = statistics.quantiles(delays, n=10)
            print(
                f"  added time per token (engine write -> client read, 1 stream at "
                f"{args.paced_tps:g} tok/s, {len(delays)} tokens): p50 "
                f"{statistics.median(delays):.2f} ms, p10 {q[0]:.2f} ms, p90 {q[-1]:.2f} ms, "
                f"mean {statistics.fmean(delays):.2f} ms; TTFT {got[0].ttft * 1000:.1f} ms"
            )
        else:
            print(f"  added time per token: no stamped tokens read ({got[0].error})")
        print(f"  {load_average()}", flush=True)
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
