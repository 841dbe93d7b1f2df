"""When does moving a conversation's KV state beat prefilling it again? (issue 16, state transfer)

Run: ``python bench/kv_transfer.py [--lengths 256,512,1024,1792] [--reps 3] [--threads 2]``.

One real llama-server (the agent's build, SmolLM2-135M Q4_1, two slots of 2048 tokens,
``--slot-save-path``), driven the way the KV coordinator's transfer drives it:

- **re-prefill**: slot 0 erased, then the prompt of L tokens evaluated (llama-server's
  ``timings.prompt_ms``; the median of ``--reps``);
- **move**: slot 0 saved (``POST /slots/0?action=save``: ``save_ms`` and the file's bytes), the
  file hashed twice (sha256: the old owner before its upload, the new owner after its download;
  the controller hashes it once more as it arrives), restored into the erased slot 1
  (``restore_ms``). The link adds ``bytes × 8 / rate`` twice (old owner → controller → new owner).
- **check**: the same prompt sent to slot 1 must take its prompt from the restored cache
  (``cache_n`` > 0) and, at temperature 0, produce the same tokens as slot 0 did.

Printed per length: prefill ms, state MiB, the fixed cost of a move (save + restore + hashing),
the ratio re-prefill / move at 1 Gbit/s, and the break-even link rate (the move wins above it).
Every request has a timeout; the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.runtime.server import find_llama_server, free_port  # noqa: E402
from tests.smollm2 import smollm2_path  # noqa: E402

HOPS = 2  # old owner → controller → new owner
WORDS = (
    "river stone lantern copper meadow signal harbor ember quiet orbit velvet thunder garden "
    "marble falcon pepper cinder violet glacier compass saddle willow beacon canyon timber"
).split()


def start_server(
    exe: Path, model: Path, slot_dir: Path, threads: int, log: Path
) -> tuple[Any, str]:
    port = free_port()
    args = [
        str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-np", "2", "-c", "4096", "--no-kv-unified", "-t", str(threads), "-tb", str(threads),
        "--no-webui", "--cache-ram", "0", "--fit", "off", "--poll", "0",
        "--slot-save-path", str(slot_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("llama-server did not come up within 120 s")


def post(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = c.post(path, json=body, timeout=600)
    if resp.status_code != 200:
        raise SystemExit(f"{path}: {resp.status_code} {resp.text[:500]}")
    out: dict[str, Any] = resp.json()
    return out


def prompt_tokens(c: httpx.Client, n: int) -> list[int]:
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n))
    tokens = list(post(c, "/tokenize", {"content": text})["tokens"])
    if len(tokens) < n:
        raise SystemExit(f"prompt of {len(tokens)} tokens is shorter than {n}")
    return tokens[:n]


def complete(c: httpx.Client, tokens: list[int], slot: int, n_predict: int) -> dict[str, Any]:
    return post(
        c,
        "/completion",
        {
            "prompt": tokens,
            "n_predict": n_predict,
            "temperature": 0,
            "id_slot": slot,
            "cache_prompt": True,
            "return_tokens": True,
        },
    )


def sha256_s(path: Path) -> float:
    t0 = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return time.perf_counter() - t0


def measure(c: httpx.Client, slot_dir: Path, n: int, reps: int) -> dict[str, float]:
    tokens = prompt_tokens(c, n)
    prefill, save, restore, hashing, size = [], [], [], [], 0
    same = True
    cached = 0
    for rep in range(reps):
        post(c, "/slots/0?action=erase", {})
        base = complete(c, tokens, 0, 8)
        prefill.append(float(base["timings"]["prompt_ms"]))
        name = f"bench-{n}-{rep}.bin"
        saved = post(c, "/slots/0?action=save", {"filename": name})
        save.append(float(saved["timings"]["save_ms"]))
        size = int(saved["n_written"])
        hashing.append(2 * sha256_s(slot_dir / name) * 1000)
        post(c, "/slots/1?action=erase", {})
        restored = post(c, "/slots/1?action=restore", {"filename": name})
        restore.append(float(restored["timings"]["restore_ms"]))
        again = complete(c, tokens, 1, 8)
        cached = int(again["timings"].get("cache_n") or 0)
        same = same and again.get("tokens") == base.get("tokens") and cached > 0
        (slot_dir / name).unlink(missing_ok=True)
    return {
        "prefill_ms": statistics.median(prefill),
        "save_ms": statistics.median(save),
        "restore_ms": statistics.median(restore),
        "hash_ms": statistics.median(hashing),
        "bytes": float(size),
        "cached": float(cached),
        "same": 1.0 if same else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,512,1024,1792")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--link-gbit", type=float, default=1.0, help="link rate for the ratio")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="racon-kvbench-") as tmp:
        slot_dir = Path(tmp)
        proc, url = start_server(
            find_llama_server(), smollm2_path(), slot_dir, args.threads, slot_dir / "server.log"
        )
        rows = []
        try:
            with httpx.Client(base_url=url) as c:
                complete(c, prompt_tokens(c, 16), 0, 1)  # warm-up
                for n in lengths:
                    rows.append((n, measure(c, slot_dir, n, args.reps)))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    rate = args.link_gbit * 1e9
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"SmolLM2-135M Q4_1, llama-server, {args.threads} threads, median of {args.reps}; "
        f"load average {load} (a busy machine slows the prefill, not the copy)"
    )
    for n, m in rows:
        fixed_ms = m["save_ms"] + m["restore_ms"] + m["hash_ms"]
        link_ms = HOPS * m["bytes"] * 8 / rate * 1000
        ratio = m["prefill_ms"] / (fixed_ms + link_ms)
        spare_s = (m["prefill_ms"] - fixed_ms) / 1000
        breakeven = (
            f"{HOPS * m['bytes'] * 8 / spare_s / 1e6:.0f} Mbit/s" if spare_s > 0 else "never"
        )
        print(
            f"{n:5d} tokens: re-prefill {m['prefill_ms']:7.1f} ms | state {m['bytes'] / 2**20:5.1f} "
            f"MiB, save {m['save_ms']:.1f} + restore {m['restore_ms']:.1f} + sha256 "
            f"{m['hash_ms']:.1f} ms | move at {args.link_gbit:g} Gbit/s {fixed_ms + link_ms:7.1f} ms"
            f" -> re-prefill/move {ratio:.2f}x | break-even link {breakeven} | restored "
            f"cache_n {m['cached']:.0f}, same output {'yes' if m['same'] else 'NO'}"
        )
    print(json.dumps({str(n): m for n, m in rows}))


if __name__ == "__main__":
    main()
