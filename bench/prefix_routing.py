"""Prefix-aware routing benchmark: the KV cache coordinator against round-robin, side by side.

Run: ``python bench/prefix_routing.py [--conversations 4] [--slots 2] [--turns 10] [--quick]``.

Two real agents, each serving one SmolLM2 replica with ``--slots`` llama-server slots of 2048
tokens (the same slots for both policies). ``--conversations`` multi-turn chats (more than one
replica's slots) run at once, each ``--turns`` turns whose context grows to about 1,500 tokens
(each user turn is ~110 tokens of distinct text; replies are ``--max-tokens`` long, temperature 0).

The two policies run one after the other on the same cluster, switched by the controller's
``racon:kv:routing`` key (apps/jobs/kvcache.py): ``prefix`` (cache-aware: each follow-up goes to
the replica and slot holding its prefix, weighed against load) and ``round_robin`` (the baseline:
replicas in turn, llama-server's own prompt cache on, ``cache_prompt`` and its LCP slot choice).
Each phase has its own conversations (distinct text), so neither inherits the other's cache.

Printed: the median time to first token of the follow-up turns (2..N) under each policy, the
prefill tokens llama-server evaluated, and one line ``prefix-aware vs round-robin median TTFT
N.NNx`` (goal >= 3x). Bounded: every request has a timeout, every phase a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import MODEL_NAME, load_average, local_cluster  # noqa: E402

GOAL = 3.0
WORDS = (
    "river stone lantern copper meadow signal harbor ember quiet orbit velvet thunder garden "
    "marble falcon pepper cinder violet glacier compass saddle willow beacon canyon timber "
    "mirror nectar prairie tundra summit anchor bramble cobalt dune fable gravel hollow ivory "
    "juniper kettle lagoon mosaic nomad oasis pebble quartz ripple sable thistle umber vessel"
).split()


def user_turn(rng: random.Random, conv: str, turn: int, words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[{conv} turn {turn}] Remember these words and answer with one short line: {body}."


def ttft_stream(
    client: httpx.Client, url: str, key: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str, str]:
    """One streamed chat: (time to first token in ms, the reply text, the deployment)."""
    body = {
        "model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    with connect_sse(
        client, "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as events:
        resp = events.response
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        dep = resp.headers.get("X-Racon-Deployment-Id", "")
        for event in events.iter_sse():
            if event.data == "[DONE]":
                continue
            obj = json.loads(event.data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            for choice in obj.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = (time.perf_counter() - t0) * 1000
                    text.append(piece)
    return (ttft if ttft is not None else (time.perf_counter() - t0) * 1000), "".join(text), dep


def run_phase(
    url: str, key: str, *, tag: str, args: argparse.Namespace, deadline_s: float
) -> dict[str, Any]:
    """All conversations at once, each its turns in order; bounded by the deadline."""
    ttfts: dict[int, list[float]] = {t: [] for t in range(1, args.turns + 1)}
    deps: dict[str, set[str]] = {}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + deadline_s

    def conversation(c: int) -> None:
        rng = random.Random(f"{tag}-{c}")
        conv = f"{tag}-c{c}"
        messages = [
            {"role": "system", "content": f"You are assistant {conv}. Reply in one short line."}
        ]
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
            for t in range(1, args.turns + 1):
                if time.monotonic() > deadline:
                    with lock:
                        errors.append(f"{conv}: deadline before turn {t}")
                    return
                messages.append({"role": "user", "content": user_turn(rng, conv, t, args.words)})
                try:
                    ms, reply, dep = ttft_stream(client, url, key, messages, args.max_tokens)
                except Exception as exc:  # reported, the phase goes on
                    with lock:
                        errors.append(f"{conv} turn {t}: {exc}")
                    return
                messages.append({"role": "assistant", "content": reply})
                with lock:
                    ttfts[t].append(ms)
                    deps.setdefault(conv, set()).add(dep)
                time.sleep(args.think)

    threads = [
        threading.Thread(target=conversation, args=(c,), daemon=True)
        for c in range(args.conversations)
    ]
    for i, th in enumerate(threads):
        th.start()
        time.sleep(0.2 * (i % 2))  # a little stagger, as users arrive
    for th in threads:
        th.join(timeout=max(1.0, deadline - time.monotonic()) + 5)
    follow = [ms for t in range(2, args.turns + 1) for ms in ttfts[t]]
    return {
        "median": statistics.median(follow) if follow else float("nan"),
        "first": statistics.median(ttfts[1]) if ttfts[1] else float("nan"),
        "n": len(follow),
        "replicas_per_conv": statistics.mean(len(v) for v in deps.values()) if deps else 0.0,
        "errors": errors,
    }


def kv_stats(cl: Any) -> dict[str, str]:
    return dict(cl.env.redis().hgetall("racon:kv:stats") or {})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--slots", type=int, default=2, help="llama-server slots per replica")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--words", type=int, default=80, help="words per user turn (~110 tokens)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument(
        "--think", type=float, default=0.3, help="seconds between a reply and the next turn"
    )
    p.add_argument("--quick", action="store_true", help="4 turns, 2 conversations")
    args = p.parse_args()
    if args.quick:
        args.turns, args.conversations = 4, 3
    print(f"== prefix routing: 2 replicas x {args.slots} slots x 2048 ctx, {args.conversations} "
          f"conversations x {args.turns} turns, {args.threads} thread(s) each; {load_average()} ==",
          flush=True)  # fmt: skip
    # Round-robin ignores load: a turn may queue behind two long prefills on a busy replica.
    os.environ.setdefault("JOB_QUEUE_WAIT_SECONDS", "600")
    with local_cluster(
        2, benchmark=False, cores=args.threads, log=lambda s: print(s, flush=True)
    ) as cl:
        names = cl.node_names
        a = cl.deploy([names[0]], n_ctx=2048, n_parallel=args.slots)
        b = cl.deploy([names[1]], n_ctx=2048, n_parallel=args.slots, allow_same_node=False)
        print(f"  replicas {a['id'][:8]} on {names[0]}, {b['id'][:8]} on {names[1]}", flush=True)
        url = cl.ctl.url + "/v1/chat/completions"
        r = cl.env.redis()
        results: dict[str, dict[str, Any]] = {}
        # Warm both replicas (weights paged in, template compiled), then the two policies.
        r.set("racon:kv:routing", "round_robin")
        for i in range(4):
            with httpx.Client(timeout=60) as client:
                ttft_stream(
                    client, url, cl.ctl.api_key, [{"role": "user", "content": f"hi {i}"}], 4
                )
        for policy in ("round_robin", "prefix"):
            r.set("racon:kv:routing", policy)
            before = kv_stats(cl)
            t0 = time.monotonic()
            res = run_phase(url, cl.ctl.api_key, tag=policy, args=args, deadline_s=900)
            res["wall"] = time.monotonic() - t0
            res["stats"] = {k: float(v) - float(before.get(k, 0)) for k, v in kv_stats(cl).items()}
            results[policy] = res
            s = res["stats"]
            print(f"  {policy:>11}: follow-up TTFT median {res['median']:.0f} ms over {res['n']} "
                  f"turns (first turn {res['first']:.0f} ms), {res['replicas_per_conv']:.1f} "
                  f"replicas per conversation, {res['wall']:.0f} s; kv hits {s.get('hits', 0):.0f} "
                  f"misses {s.get('misses', 0):.0f} displaced {s.get('displaced', 0):.0f}"
                  + (f"; errors {len(res['errors'])}: {res['errors'][:2]}" if res["errors"] else ""),
                  flush=True)  # fmt: skip
        r.delete("racon:kv:routing")
    rr, px = results["round_robin"]["median"], results["prefix"]["median"]
    ratio = rr / px if px and px == px and rr == rr else float("nan")
    print(f"prefix-aware vs round-robin median TTFT (turns 2-{args.turns}): {rr:.0f} ms / {px:.0f} ms "
          f"= {ratio:.2f}x [goal >= {GOAL:.2f}x] {'PASS' if ratio >= GOAL else 'FAIL'}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
