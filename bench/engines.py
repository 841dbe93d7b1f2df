"""Engines benchmark (issue 30): RACoN over vLLM, bare vLLM, and RACoN over llama.cpp, side by side.

Run: ``python bench/engines.py [--levels 1,8,16] [--max-tokens 64] [--n-ctx 512] [--quick]``.

One local cluster (controller, one agent with RACON_ENGINES=llamacpp,vllm), the SmolLM2 model:
its GGUF (Q4_1) for llama.cpp and its safetensors directory (scripts/install-vllm.sh) for vLLM.
The three sides run one after the other, so that only one engine holds the cores at a time:

1. RACoN over vLLM: a deployment with engine vllm (one node, float32, eager), through /v1;
2. bare vLLM: the same vLLM server, with the same arguments and thread cap, started here and
   called on its own /v1/chat/completions;
3. RACoN over llama.cpp: a deployment of the GGUF with the same slots, through /v1.

Each side runs, per level (1, 8, 16 streams), ``2 x streams`` streamed chats with ``streams`` at a
time (``--quick``: one wave of ``streams`` requests of 32 tokens; 3 requests at one stream), with
``stream_options.include_usage`` so every side counts completion tokens the same way. Printed per
level: aggregate tokens/s of each side, TTFT p50, and the ratios RACoN-vLLM / bare vLLM (what
RACoN costs over vLLM) and RACoN-vLLM / RACoN-llama.cpp (what the engine changes). These are
float32 weights against a 4-bit GGUF: not the same work; they show where each engine wins.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import MODEL_NAME, load_average, local_cluster  # noqa: E402
from bench.concurrency import Turn, level_turn, pct, run_turn  # noqa: E402
from tests.e2e.harness import free_port, wait_for  # noqa: E402

MODEL_DIR = (
    Path(os.environ.get("RACON_CACHE") or Path.home() / ".cache" / "racon")
    / "models"
    / "smollm2-135m-safetensors"
)
SIDES = ("racon-vllm", "bare-vllm", "racon-llamacpp")


def measure(
    url: str, key: str, levels: list[int], args: argparse.Namespace, label: str
) -> dict[int, Turn]:
    run_turn(url, key, streams=2, requests=2, max_tokens=8, model=MODEL_NAME, offset=0)  # warm
    out: dict[int, Turn] = {}
    for streams in levels:
        n_req = (
            (streams if streams > 1 else 3) if args.quick else (2 * streams if streams > 1 else 6)
        )
        turn = level_turn(url, key, args, streams=streams, requests=n_req, offset=100 * streams)
        out[streams] = turn
        ttft = pct([r.ttft_ms for r in turn.results], 0.5)
        errs = f", {len(turn.errors)} errors: {turn.errors[:1]}" if turn.errors else ""
        print(
            f"  {label:>14} {streams:>2} streams: {turn.aggregate:6.1f} tok/s, "
            f"TTFT p50 {ttft:7.1f} ms ({len(turn.results)} requests{errs})",
            flush=True,
        )
    return out


def start_bare_vllm(
    n_ctx: int, slots: int, threads: int, log_path: Path
) -> tuple[subprocess.Popen[bytes], str, str]:
    """vLLM's OpenAI server with the agent's own arguments and environment (agent/runtime/vllm.py),
    served as MODEL_NAME, in a process group of its own."""
    from agent.runtime.vllm import engine_env, engine_python, server_args

    python = engine_python()
    if python is None:
        raise SystemExit("the vLLM engine venv is missing: run scripts/install-vllm.sh")
    plan: Any = {
        "deployment_id": MODEL_NAME,
        "n_ctx": n_ctx,
        "n_parallel": slots,
        "n_threads": threads,
        "kv_bytes": 0,
    }
    key = secrets.token_hex(16)
    port = free_port()
    logf = open(log_path, "wb")  # closed with the process
    proc = subprocess.Popen(
        [str(python), *server_args(plan, MODEL_DIR, port)],
        stdout=logf,
        stderr=subprocess.STDOUT,
        env=engine_env(plan, key),
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
            )
        try:
            r = httpx.post(
                base + "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
                timeout=10,
            )
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 900, "bare vLLM to answer a one-token probe", interval=1.0)
    return proc, base, key


def _vllm_alive(needle: str) -> bool:
    for pid_dir in Path("/proc").iterdir():
        try:
            cmd = (pid_dir / "cmdline").read_bytes() if pid_dir.name.isdigit() else b""
        except OSError:
            continue
        if b"vllm.entrypoints" in cmd and needle.encode() in cmd:
            return True
    return False


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--levels", default="1,8,16")
    p.add_argument("--n-ctx", type=int, default=512, help="context per sequence")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="one wave per level, 32 tokens")
    p.add_argument("--workdir", type=Path, help="keep the cluster's files (logs) here")
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    slots = max(levels)
    if not (MODEL_DIR / "SHA256SUMS").is_file():
        raise SystemExit(f"{MODEL_DIR} is missing: run scripts/install-vllm.sh")
    os.environ["RACON_ENGINES"] = "llamacpp,vllm"  # the agents inherit it
    # bench/common.py's cluster uses a numbered database of the shared Redis, and a node's own
    # Redis user may not SELECT one: without per-node users here (they cost nothing per token).
    os.environ.setdefault("NODE_REDIS_ACL", "0")
    os.environ.setdefault("RACON_VLLM_LOAD_TIMEOUT", "900")
    print(
        f"== engines: RACoN over vLLM vs bare vLLM vs RACoN over llama.cpp, SmolLM2-135M "
        f"(vLLM float32 eager, llama.cpp Q4_1), {slots} slots x {args.n_ctx} ctx, "
        f"{'quick, ' if args.quick else ''}{load_average()} ==",
        flush=True,
    )
    results: dict[str, dict[int, Turn]] = {}
    with local_cluster(
        1, workdir=args.workdir, benchmark=False, log=lambda s: print(s, flush=True)
    ) as cl:
        node = cl.node_names[0]
        (cl.workdir / "models" / MODEL_DIR.name).symlink_to(MODEL_DIR)
        reg = cl.ctl.post("/api/admin/models", {"path": str(MODEL_DIR), "name": MODEL_NAME})
        if reg.status_code != 201:
            raise RuntimeError(f"model directory refused: {reg.status_code} {reg.text[:300]}")
        url = cl.ctl.url + "/v1/chat/completions"
        t0 = time.monotonic()
        dep = cl.deploy(
            [node], spread=False, n_ctx=args.n_ctx, n_parallel=slots, engine="vllm", timeout=1000
        )
        print(f"  vLLM deployment READY in {time.monotonic() - t0:.0f} s", flush=True)
        results["racon-vllm"] = measure(url, cl.ctl.api_key, levels, args, "RACoN-vLLM")
        cl.stop_deployment(dep["id"])
        wait_for(lambda: not _vllm_alive(dep["id"]), 60, "the vLLM deployment's server to stop")
        proc, base, key = start_bare_vllm(
            args.n_ctx, slots, int(dep["plan"]["n_threads"]), cl.workdir / "bare-vllm.log"
        )
        try:
            results["bare-vllm"] = measure(
                base + "/v1/chat/completions", key, levels, args, "bare vLLM"
            )
        finally:
            stop_group(proc)
        # Named: with its directory registered and slots >= VLLM_AUTO_MIN_PARALLEL, the
        # scheduler's own choice for this model would be vLLM.
        dep = cl.deploy([node], spread=False, n_ctx=args.n_ctx, n_parallel=slots, engine="llamacpp")
        results["racon-llamacpp"] = measure(url, cl.ctl.api_key, levels, args, "RACoN-llama.cpp")
    print(
        "\nstreams | RACoN-vLLM | bare vLLM | RACoN-llama.cpp | RACoN-vLLM/bare | "
        "RACoN-vLLM/RACoN-llama.cpp | TTFT p50 ms (RACoN-vLLM, bare, RACoN-llama.cpp)"
    )
    for streams in levels:
        agg = {s: results[s][streams].aggregate for s in SIDES}
        ttft = {s: pct([r.ttft_ms for r in results[s][streams].results], 0.5) for s in SIDES}

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b else "n/a"

        print(
            f"{streams:>7} | {agg['racon-vllm']:7.1f} t/s | {agg['bare-vllm']:6.1f} t/s | "
            f"{agg['racon-llamacpp']:9.1f} t/s | {ratio(agg['racon-vllm'], agg['bare-vllm']):>15} | "
            f"{ratio(agg['racon-vllm'], agg['racon-llamacpp']):>26} | "
            f"{ttft['racon-vllm']:.0f}, {ttft['bare-vllm']:.0f}, {ttft['racon-llamacpp']:.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
