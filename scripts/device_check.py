#!/usr/bin/env python3
"""The device check's Python half (scripts/device-check.sh): no network, no RACoN controller.

    device_check.py model OUT.gguf          write a random-weight model of SmolLM2's shape (gguf-py)
    device_check.py inventory               NVML and ggml (the agent's own code) must see the same GPUs
    device_check.py gpu-timing URL          a timed prompt pass on the GPU through llama-server
    device_check.py gpu-challenge DEV [M N K [CLAIM]]  the GPU speed challenge on DEV (CUDA0), as
                                            the controller runs it: prepare (untimed), the nonce's
                                            product timed to its digest, reveal, Freivalds
    device_check.py streams URL N [N ...]   N concurrent streamed completions: aggregate tok/s, TTFT

Only the standard library, numpy, httpx and nvidia-ml-py (pynvml) are needed, plus the agent
package from this checkout and gguf-py from the llama.cpp tree (PYTHONPATH).
"""

from __future__ import annotations

import base64
import json
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

# SmolLM2-135M's shape (FACTS.md): llama, 30 layers, n_embd 576, 9 heads, 3 KV heads.
SHAPE = {"n_layer": 30, "n_embd": 576, "n_head": 9, "n_head_kv": 3, "n_ff": 1536, "n_vocab": 49152}


def write_model(path: Path) -> None:
    from gguf import GGUFWriter, TokenType  # noqa: PLC0415 - gguf-py of the llama.cpp tree (PYTHONPATH)

    s = SHAPE
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_name("device-check-random")
    w.add_context_length(8192)
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_dimension_count(s["n_embd"] // s["n_head"])
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # mostly F16
    # A SentencePiece-style vocabulary: unk, bos, eos, the 256 byte tokens, then plain pieces.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(s["n_vocab"] - len(tokens))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * (s["n_vocab"] - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def mat(rows: int, cols: int) -> Any:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    e, hd = s["n_embd"], s["n_embd"] // s["n_head"]
    w.add_tensor("token_embd.weight", mat(s["n_vocab"], e))
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    for i in range(s["n_layer"]):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(e, dtype=np.float32))
        w.add_tensor(f"{b}.attn_q.weight", mat(e, e))
        w.add_tensor(f"{b}.attn_k.weight", mat(s["n_head_kv"] * hd, e))
        w.add_tensor(f"{b}.attn_v.weight", mat(s["n_head_kv"] * hd, e))
        w.add_tensor(f"{b}.attn_output.weight", mat(e, e))
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(e, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_gate.weight", mat(s["n_ff"], e))
        w.add_tensor(f"{b}.ffn_up.weight", mat(s["n_ff"], e))
        w.add_tensor(f"{b}.ffn_down.weight", mat(e, s["n_ff"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"model: {path} ({path.stat().st_size / 2**20:.0f} MiB, SmolLM2's shape, random F16)")


def inventory() -> int:
    """The agent's own inventory: ggml's devices in a child process, matched to NVML."""
    from agent.hardware import nvml  # noqa: PLC0415 - the checkout on PYTHONPATH, only here
    from agent.hardware.devices import DeviceScanner, describe, gpu_infos  # noqa: PLC0415

    scan = DeviceScanner().scan(fresh=True)
    for line in describe(scan):
        print(f"ggml {line}")
    nv = nvml.detect_gpus()
    for g in nv:
        print(f"nvml gpu {g['index']}: {g['name']} {g['vram_total'] >> 20} MiB "
              f"({g['vram_free'] >> 20} MiB free) bus {g.get('pci_bus_id', '?')}")  # fmt: skip
    infos = gpu_infos(scan, nv)
    for info in infos:
        print(f"inventory: {info.get('device')} = nvml {info.get('nvml_index', 'none')} "
              f"{info['name']} {info['vram_total'] >> 20} MiB")  # fmt: skip
    cuda = [i for i in infos if i.get("backend") == "CUDA"]
    same = len(cuda) == len(nv) and all("nvml_index" in i for i in cuda)
    print(f"inventory check: {len(nv)} NVML GPU(s), {len(cuda)} CUDA device(s), every CUDA device "
          f"matched to NVML: {same}  {'PASS' if same and nv else 'FAIL'}")  # fmt: skip
    for row in nvml.gpu_stats():
        print(f"nvml stats: {row}")
    return 0 if same and nv else 1


def gpu_timing(url: str) -> None:
    """A prompt pass on the GPU, timed by llama-server itself and by the round trip: what the
    GPU speed claim stands for (2 FLOPs per parameter per prompt token)."""
    prompt = [259 + (i * 7919) % 40000 for i in range(480)]  # token ids: exactly 480 tokens
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "cache_prompt": False}
    httpx.post(url + "/completion", json=body, timeout=300)  # warm-up: kernels, graphs
    started = time.perf_counter()
    got = httpx.post(url + "/completion", json=body, timeout=300).json()
    wall = time.perf_counter() - started
    if "timings" not in got:
        print(f"gpu timing: FAIL, llama-server answered {str(got)[:300]}")
        return
    t = got.get("timings", {})
    n_params = 134_515_008  # SmolLM2-135M's shape
    pp = float(t.get("prompt_per_second") or 0)
    print(f"gpu timing: prompt {t.get('prompt_n')} tokens at {pp:.0f} tok/s "
          f"(~{2 * n_params * pp / 1e9:.0f} GFLOPS), decode {t.get('predicted_per_second', 0):.0f} tok/s, "
          f"round trip {wall * 1000:.0f} ms")  # fmt: skip


def gpu_challenge(device: str, m: int, n: int, k: int, claims: list[float]) -> int:
    """The controller's GPU speed challenge (apps/nodes/gpu_challenges.py) without the controller,
    in its two phases: the agent's own child (agent.runtime.ggml_matmul.ChallengeChild) prepares
    the seed's inputs on ``device`` through the build at RACON_LLAMA_SERVER (untimed), a ping
    measures the pipe's round trip, then only the nonce is timed, from its send to the digest of
    B·D·Aᵀ; the residues follow untimed and must hash to that digest and pass Freivalds' check.
    Prints the measured figure and the verdict each claim would get (claimed > measured x 1.5
    fails), with the controller's allowance (the ping, at most a quarter of the timed step)."""
    # The agent package: the checkout on PYTHONPATH, needed by this subcommand only.
    from agent.hardware.gpu_challenge import (  # noqa: PLC0415
        challenge_flops,
        freivalds_check,
        residue_digest,
    )
    from agent.runtime.ggml_matmul import ChallengeChild  # noqa: PLC0415

    seed, nonce = secrets.randbits(63), secrets.randbits(63)
    started = time.perf_counter()
    child = ChallengeChild({"device": device, "seed": seed, "m": m, "n": n, "k": k})
    try:
        ready = child.ask(None, timeout=400)
        prepare_s = time.perf_counter() - started
        if ready.get("ready") is not True:
            print(f"gpu challenge on {device}: prepare FAIL {ready.get('error', ready)}")
            return 1
        t = time.perf_counter()
        pong = child.ask({"ping": "x"}, timeout=60)
        overhead = time.perf_counter() - t
        t = time.perf_counter()
        ran = child.ask({"nonce": nonce}, timeout=400)
        seconds = time.perf_counter() - t
        got = child.ask({"reveal": True}, timeout=60)
    finally:
        child.close()
    answer = str(got.get("answer", ""))
    ok = (
        pong.get("pong") == "x"
        and ran.get("nonce") == nonce
        and residue_digest(base64.b64decode(answer), nonce=nonce) == ran.get("digest")
        and freivalds_check(answer, seed=seed, nonce=nonce, m=m, n=n, k=k)
    )
    error = str(ran.get("error") or got.get("error") or "")
    allowance = min(overhead, 20.0, seconds / 4)
    flops = challenge_flops(m=m, n=n, k=k)
    measured = flops / max(seconds - allowance, 1e-6) / 1e9 if ok else 0.0
    print(f"gpu challenge on {device}: prepared {m}x{n}x{k} in {prepare_s:.3f} s (untimed: "
          f"inputs, upload, a zero-scale warm-up run), ping {overhead * 1000:.1f} ms")  # fmt: skip
    print(f"gpu challenge on {device}: {flops / 1e9:.3g} GFLOP from the nonce to the digest in "
          f"{seconds:.3f} s (less {allowance:.3f} s), digest+Freivalds "
          f"{'PASS' if ok else 'FAIL ' + error}, measured {measured:.4g} GFLOPS")  # fmt: skip
    for claim in claims:
        verdict = "verified" if ok and claim <= measured * 1.5 else "failed"
        print(f"gpu challenge verdict for a {claim:g} GFLOPS claim: {verdict}")
    return 0 if ok else 1


def streams(url: str, counts: list[int], max_tokens: int = 64) -> None:
    for n in counts:
        ttft: list[float] = []
        tokens = [0] * n
        errors: list[str] = []

        def one(
            i: int, tokens: list[int] = tokens, ttft: list[float] = ttft, errors: list[str] = errors
        ) -> None:
            body = {"prompt": [259 + i, 300 + i, 400 + i], "n_predict": max_tokens,
                    "temperature": 0.7, "stream": True, "cache_prompt": False}  # fmt: skip
            start = time.perf_counter()
            first = None
            try:
                with httpx.stream("POST", url + "/completion", json=body, timeout=300) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        ev = json.loads(line[6:])
                        if ev.get("content") or ev.get("tokens"):
                            if first is None:
                                first = time.perf_counter() - start
                            tokens[i] += max(1, len(ev.get("tokens") or []))
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(str(exc))
            if first is not None:
                ttft.append(first)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        p50 = statistics.median(ttft) * 1000 if ttft else float("nan")
        print(f"streams {n:>3}: aggregate {sum(tokens) / wall:8.1f} tok/s, TTFT p50 {p50:7.0f} ms, "
              f"{sum(tokens)} tokens in {wall:.1f} s, errors {len(errors)}")  # fmt: skip


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "model":
        write_model(Path(rest[0]))
        return 0
    if cmd == "inventory":
        return inventory()
    if cmd == "gpu-timing":
        gpu_timing(rest[0])
        return 0
    if cmd == "gpu-challenge":
        m, n, k = [int(x) for x in rest[1:4]] or [1024, 1024, 16384]  # the controller's defaults
        return gpu_challenge(rest[0], m, n, k, claims=[float(x) for x in rest[4:]] or [900_000.0])
    if cmd == "streams":
        streams(rest[0], [int(x) for x in rest[1:]])
        return 0
    print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
