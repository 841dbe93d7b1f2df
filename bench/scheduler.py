"""Scheduler benchmark: plan quality against brute force and the exo rule, and decision time.

Run: ``python bench/scheduler.py [--clusters 1000] [--seed 1]``. Prints, in one run:

1. plan quality on N random heterogeneous clusters (2–8 nodes): predicted tokens/s of
   ``plan_placement`` as a fraction of ``exhaustive_best`` (targets: mean ≥ 98%, worst ≥ 90%),
   and against ``memory_proportional_plan`` (the exo rule);
2. decision time on a 1,000-node cluster, p50/p99 as a fraction of the 50 ms target;
3. predicted against measured tokens/s on real loopback deployments: a hook left for the
   deployment code (``measure_loopback``), reported as "not run" until it is filled in.

Every figure compares things measured side by side in this run; absolute times are secondary.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apps.jobs.scheduler import (  # noqa: E402
    ClusterSnapshot,
    DeviceSnapshot,
    Link,
    NodeSnapshot,
    PlacementRefused,
    PlacementRequest,
    Plan,
    exhaustive_best,
    memory_proportional_plan,
    plan_placement,
)
from apps.models_repo.profile import ModelProfile, synthetic_profile  # noqa: E402

GiB = 1 << 30
DECISION_TARGET_MS = 50.0
QUALITY_MEAN_TARGET = 0.98
QUALITY_WORST_TARGET = 0.90


# Shapes of real model families (llama-style); sizes from ~0.1B to 70B so that some fit one
# device, some need a split and some need most of a small cluster.
def models() -> list[ModelProfile]:
    return [
        synthetic_profile(
            name="smollm2-135m",
            n_layer=30,
            n_embd=576,
            n_head=9,
            n_head_kv=3,
            n_ff=1536,
            n_vocab=49152,
            quantization="Q8_0",
            tied_embeddings=True,
        ),
        synthetic_profile(
            name="llama-3.2-1b",
            n_layer=16,
            n_embd=2048,
            n_head=32,
            n_head_kv=8,
            n_ff=8192,
            n_vocab=128256,
            quantization="Q8_0",
            tied_embeddings=True,
        ),
        synthetic_profile(
            name="llama-3.1-8b",
            n_layer=32,
            n_embd=4096,
            n_head=32,
            n_head_kv=8,
            n_ff=14336,
            n_vocab=128256,
        ),
        synthetic_profile(
            name="qwen-14b",
            n_layer=48,
            n_embd=5120,
            n_head=40,
            n_head_kv=8,
            n_ff=13824,
            n_vocab=152064,
        ),
        synthetic_profile(
            name="llama-33b",
            n_layer=60,
            n_embd=6656,
            n_head=52,
            n_head_kv=52,
            n_ff=17920,
            n_vocab=32000,
        ),
        synthetic_profile(
            name="llama-3.1-70b",
            n_layer=80,
            n_embd=8192,
            n_head=64,
            n_head_kv=8,
            n_ff=28672,
            n_vocab=128256,
        ),
    ]


def random_node(rng: random.Random, i: int, *, states: bool = True) -> NodeSnapshot:
    """A home/office machine: a CPU with some RAM free, maybe one or two GPUs."""
    node_id = f"node-{i}"
    ram = rng.choice([2, 4, 8, 16, 32, 64, 128]) * GiB * rng.uniform(0.3, 0.9)
    cpu_gflops = rng.uniform(40, 1200)
    cpu_bw = rng.uniform(8, 120)
    devices = [DeviceSnapshot(node_id, "CPU", "cpu", int(ram), cpu_gflops, cpu_bw)]
    n_gpu = rng.choices([0, 1, 2], weights=[5, 4, 1])[0]
    for g in range(n_gpu):
        vram = rng.choice([4, 6, 8, 12, 16, 24, 48, 80]) * GiB * rng.uniform(0.5, 0.95)
        devices.append(
            DeviceSnapshot(
                node_id,
                f"GPU{g}",
                "gpu",
                int(vram),
                rng.uniform(2_000, 100_000),
                rng.uniform(150, 3000),
            )
        )
    state = "READY"
    if states:
        state = rng.choices(["READY", "DEGRADED", "DRAINING", "BUSY"], weights=[85, 7, 4, 4])[0]
    return NodeSnapshot(
        node_id=node_id,
        name=node_id,
        state=state,
        address=f"10.0.{i // 250}.{i % 250 + 1}",
        rpc_port=50052,
        devices=tuple(devices),
        threads=rng.choice([2, 4, 8, 16]),
        has_model_file=rng.random() < 0.3,
    )


def random_cluster(
    rng: random.Random, n_nodes: int, *, probe_fraction: float = 0.7
) -> ClusterSnapshot:
    """Random nodes and links: LAN, Wi-Fi and slow links; some pairs never probed."""
    nodes = tuple(random_node(rng, i) for i in range(n_nodes))
    links: dict[tuple[str, str], Link] = {}
    for a in range(n_nodes):
        for b in range(a + 1, n_nodes):
            if rng.random() < probe_fraction:
                kind = rng.choices(["lan10g", "lan1g", "wifi", "wan"], weights=[2, 5, 3, 1])[0]
                rtt, bw = {
                    "lan10g": (rng.uniform(0.05, 0.2), rng.uniform(5000, 10000)),
                    "lan1g": (rng.uniform(0.1, 0.6), rng.uniform(600, 950)),
                    "wifi": (rng.uniform(1.0, 6.0), rng.uniform(50, 400)),
                    "wan": (rng.uniform(5.0, 30.0), rng.uniform(20, 200)),
                }[kind]
                links[(nodes[a].node_id, nodes[b].node_id)] = Link(rtt, bw)
    return ClusterSnapshot(nodes=nodes, links=links)


def random_request(rng: random.Random) -> PlacementRequest:
    return PlacementRequest(
        n_ctx=rng.choice([2048, 4096, 8192]),
        n_parallel=rng.choice([1, 1, 2, 4]),
        prompt_tokens=rng.choice([32, 128, 512, 2048]),
    )


@dataclass
class QualityResult:
    ratios_exhaustive: list[float]
    ratios_split: list[float]  # the subset where the optimum spans several nodes
    ratios_proportional: list[float]
    both_refused: int
    only_greedy_refused: int
    only_exhaustive_refused: int
    single_node: int
    clusters: int


def _plan(
    fn: Callable[[ModelProfile, ClusterSnapshot, PlacementRequest], Plan],
    profile: ModelProfile,
    cluster: ClusterSnapshot,
    request: PlacementRequest,
) -> Plan | None:
    try:
        return fn(profile, cluster, request)
    except PlacementRefused:
        return None


def bench_quality(n_clusters: int, seed: int) -> QualityResult:
    rng = random.Random(seed)
    profiles = models()
    res = QualityResult([], [], [], 0, 0, 0, 0, n_clusters)
    for _ in range(n_clusters):
        cluster = random_cluster(rng, rng.randint(2, 8))
        profile = rng.choice(profiles)
        request = random_request(rng)
        plan = _plan(plan_placement, profile, cluster, request)
        best = _plan(exhaustive_best, profile, cluster, request)
        if plan is not None and len(plan.node_ids) == 1:
            res.single_node += 1
        if best is None and plan is None:
            res.both_refused += 1
            continue
        if plan is None:
            res.only_greedy_refused += 1
            res.ratios_exhaustive.append(0.0)
            continue
        if best is None:
            res.only_exhaustive_refused += 1
            continue
        ratio = plan.predicted_tokens_per_s / best.predicted_tokens_per_s
        res.ratios_exhaustive.append(ratio)
        if len(best.node_ids) > 1:
            res.ratios_split.append(ratio)
        prop = _plan(memory_proportional_plan, profile, cluster, request)
        if prop is not None:
            res.ratios_proportional.append(
                plan.predicted_tokens_per_s / prop.predicted_tokens_per_s
            )
    return res


def bench_decision_time(n_nodes: int, decisions: int, seed: int) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms) per plan_placement call on one big cluster, varied models and requests.

    CPU time is reported too because a shared machine inflates wall time; the scheduler is
    single-threaded, so on a quiet machine the two agree.
    """
    rng = random.Random(seed + 1000)
    cluster = random_cluster(rng, n_nodes, probe_fraction=0.002)
    profiles = models()
    # Warm-up so imports and first-call costs do not count.
    plan_placement(profiles[2], cluster, PlacementRequest())
    wall, cpu = [], []
    for i in range(decisions):
        profile = profiles[i % len(profiles)]
        request = random_request(rng)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            plan_placement(profile, cluster, request)
        except PlacementRefused:
            pass
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return wall, cpu


# --- part 3: predicted vs measured on real loopback deployments --------------------------------


def measure_loopback(n_nodes: int) -> tuple[float, float] | None:
    """Hook for the deployment code: (predicted tok/s, measured tok/s) for a real deployment of
    SmolLM2 spread over ``n_nodes`` loopback agents, or None when it cannot run here.

    To fill in: start n loopback RPC workers, benchmark them as agents do (gflops, bandwidth),
    build the ClusterSnapshot, call plan_placement with PlacementRequest(spread=True,
    pin_nodes=...), load the primary with the plan's rpc_endpoints / tensor_split /
    n_gpu_layers, generate ~128 tokens at temperature 0, and return both figures.
    """
    return None


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--big-nodes", type=int, default=1000)
    ap.add_argument("--decisions", type=int, default=50)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    q = bench_quality(args.clusters, args.seed)
    t_quality = time.perf_counter() - t0
    r = q.ratios_exhaustive
    mean = statistics.fmean(r) if r else float("nan")
    worst = min(r) if r else float("nan")
    below = sum(1 for x in r if x < 0.999)
    print(f"== plan quality on {q.clusters} random clusters (2-8 nodes), seed {args.seed} ==")
    print(
        f"plan_placement / exhaustive_best (predicted tok/s): mean {mean:.2%}  worst {worst:.2%}  "
        f"[targets: mean >= {QUALITY_MEAN_TARGET:.0%}, worst >= {QUALITY_WORST_TARGET:.0%}]  "
        f"{'PASS' if mean >= QUALITY_MEAN_TARGET and worst >= QUALITY_WORST_TARGET else 'FAIL'}"
    )
    print(
        f"  plans below the optimum: {below} of {len(r)} compared; single-node plans: {q.single_node}"
    )
    if q.ratios_split:
        print(
            f"  where the optimum is a multi-node split (n={len(q.ratios_split)}): "
            f"mean {statistics.fmean(q.ratios_split):.2%}  worst {min(q.ratios_split):.2%}"
        )
    print(
        f"  refusals: both {q.both_refused}, only plan_placement {q.only_greedy_refused}, "
        f"only exhaustive {q.only_exhaustive_refused}"
    )
    p = q.ratios_proportional
    if p:
        print(
            f"plan_placement / memory_proportional (exo rule): mean {statistics.fmean(p):.2f}x  "
            f"median {statistics.median(p):.2f}x  worst {min(p):.2f}x  (n={len(p)})"
        )

    wall, cpu = bench_decision_time(args.big_nodes, args.decisions, args.seed)
    p50, p99 = percentile(wall, 50), percentile(wall, 99)
    c50, c99 = percentile(cpu, 50), percentile(cpu, 99)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"== decision time on a {args.big_nodes}-node cluster ({len(wall)} decisions) ==")
    print(
        f"wall p50 {p50 / DECISION_TARGET_MS:.2f}x of the {DECISION_TARGET_MS:.0f} ms target, "
        f"p99 {p99 / DECISION_TARGET_MS:.2f}x  {'PASS' if p99 <= DECISION_TARGET_MS else 'FAIL'};  "
        f"CPU p50 {c50 / DECISION_TARGET_MS:.2f}x, p99 {c99 / DECISION_TARGET_MS:.2f}x"
    )
    print(
        f"  (wall p50 {p50:.1f} ms, p99 {p99:.1f} ms; CPU p50 {c50:.1f} ms, p99 {c99:.1f} ms; "
        f"load average {load:.1f} on {os.cpu_count()} CPUs)"
    )

    print("== predicted vs measured tokens/s, loopback deployments ==")
    for n in (1, 2, 3):
        m = measure_loopback(n)
        if m is None:
            print(f"{n} node(s): not run (measure_loopback is a hook for the deployment code)")
        else:
            pred, meas = m
            print(
                f"{n} node(s): predicted/measured {pred / meas:.2f} (error {pred / meas - 1:+.0%})"
            )
    print(f"(quality part took {t_quality:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
