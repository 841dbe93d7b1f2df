"""Scheduler benchmark: plan quality against brute force and the exo rule, and decision time.

Run: ``python bench/scheduler.py [--clusters 1000] [--seed 1] [--no-loopback] [--quick]``. Prints, in one run:

1. plan quality on N random heterogeneous clusters (2–8 nodes): predicted tokens/s of
   ``plan_placement`` as a fraction of ``exhaustive_best`` (targets: mean ≥ 98%, worst ≥ 90%),
   and against ``memory_proportional_plan`` (the exo rule);
2. decision time on a 1,000-node cluster, p50/p99 as a fraction of the 50 ms target;
3. predicted against measured tokens/s on real loopback deployments of SmolLM2 over 1, 2 and 3
   agents (``measure_loopback``; target within +-30%), and which cost-model constant or node
   figure would have to change, and by how much, for the two to agree. ``--no-loopback`` skips it.

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
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apps.jobs.scheduler import (
    DEFAULT_COST,
    DEFAULT_LINK,
    ClusterSnapshot,
    CostModel,
    DeviceSnapshot,
    Link,
    NodeSnapshot,
    PlacementRefused,
    PlacementRequest,
    Plan,
    plan_placement,
)
from apps.jobs.scheduler.reference import exhaustive_best, memory_proportional_plan
from apps.models_repo.profile import ModelProfile, synthetic_profile

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

# One real cluster (controller + 3 loopback agents, started without --no-benchmark so the plans
# use the figures the agents measured) serves the 1-, 2- and 3-node measurements in turn; it is
# started on first use and stopped by close_loopback().
LOOPBACK_N_CTX = 1024
LOOPBACK_AGENTS = 3
_LOOPBACK: dict[str, Any] = {"requests": 5, "warmup": 2, "max_tokens": 128, "results": {}}


def _loopback_cluster() -> Any:
    if "cluster" not in _LOOPBACK:
        from bench.common import local_cluster  # Django and processes only when used

        stack = ExitStack()
        _LOOPBACK["stack"] = stack
        print(
            f"  starting a controller and {LOOPBACK_AGENTS} loopback agents (agents run their benchmark)",
            flush=True,
        )
        _LOOPBACK["cluster"] = stack.enter_context(
            local_cluster(LOOPBACK_AGENTS, log=lambda m: print(m, flush=True), name_prefix="loop")
        )
    return _LOOPBACK["cluster"]


def close_loopback() -> None:
    stack = _LOOPBACK.pop("stack", None)
    _LOOPBACK.pop("cluster", None)
    if stack is not None:
        stack.close()


def _scaled_snapshot(
    snap: ClusterSnapshot, *, compute: float = 1.0, link: Link | None = None
) -> ClusterSnapshot:
    """The snapshot with every device's gflops and bandwidth times `compute`, every link `link`."""
    nodes = tuple(
        replace(
            n,
            devices=tuple(
                replace(
                    d, gflops=d.gflops * compute, mem_bandwidth_gbps=d.mem_bandwidth_gbps * compute
                )
                for d in n.devices
            ),
        )
        for n in snap.nodes
    )
    if link is None:
        return replace(snap, nodes=nodes)
    return replace(snap, nodes=nodes, links={}, default_link=link)


def _solve(fn: Callable[[float], float], target: float, lo: float, hi: float) -> float | None:
    """x in [lo, hi] with fn(x) == target for a monotone fn (bisection), None when out of range."""
    f_lo, f_hi = fn(lo) - target, fn(hi) - target
    if f_lo * f_hi > 0:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        f_mid = fn(mid) - target
        if f_lo * f_mid <= 0:
            hi = mid
        else:
            lo, f_lo = mid, f_mid
    return (lo + hi) / 2


def measure_loopback(n_nodes: int) -> tuple[float, float] | None:
    """(predicted tok/s, measured tok/s) for a real deployment of SmolLM2 spread over ``n_nodes``
    loopback agents, or None when it cannot run here (the reason is kept for the report).

    Predicted: the deployed plan's predicted_tokens_per_s. Measured: the primary's own decode rate
    (the job's tokens_per_s, what the prediction models), median over a few streamed requests at
    temperature 0 after warm-up requests.
    """
    import httpx

    try:
        cl = _loopback_cluster()
    except Exception as exc:  # reported, not raised: parts 1 and 2 still stand
        _LOOPBACK["error"] = f"{type(exc).__name__}: {exc}"
        return None
    from apps.jobs.selectors import cluster_snapshot
    from apps.models_repo.models import Model
    from bench.gateway import prompt, racon_request

    names = cl.node_names[:n_nodes]
    mf = Model.objects.get(name="smollm2").files.order_by("-created_at").first()
    profile = ModelProfile.from_dict(mf.profile)
    snap = cluster_snapshot(model_file=mf)  # what the controller's scheduler sees right now
    dep = cl.deploy(names, spread=True, n_ctx=LOOPBACK_N_CTX)
    plan = dep["plan"]
    runtime: list[float] = []
    client: list[float] = []
    try:
        key = cl.ctl.api_key
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=10.0)) as http:
            for i in range(_LOOPBACK["warmup"] + _LOOPBACK["requests"]):
                r = racon_request(http, cl.ctl.url, key, prompt(i), _LOOPBACK["max_tokens"])
                if i < _LOOPBACK["warmup"]:
                    continue
                job = cl.job(r.job_id)
                if job.get("tokens_per_s"):
                    runtime.append(float(job["tokens_per_s"]))
                if r.first_s is not None and r.last_s and r.last_s > r.first_s:
                    client.append((r.chunks - 1) / (r.last_s - r.first_s))
    finally:
        cl.stop_deployment(dep["id"])
    by_id = {n.node_id: n for n in snap.nodes}
    pins = tuple(n.node_id for n in snap.nodes if n.name in names)
    request = PlacementRequest(n_ctx=LOOPBACK_N_CTX, pin_nodes=pins, spread=True)
    _LOOPBACK["results"][n_nodes] = {
        "plan": plan,
        "runtime": runtime,
        "client": client,
        "snap": snap,
        "profile": profile,
        "request": request,
        "figures": sorted(
            {(by_id[p].devices[0].gflops, by_id[p].devices[0].mem_bandwidth_gbps) for p in pins}
        ),
        "layers": [(d.get("node_id"), d.get("n_layers")) for d in plan.get("devices", [])],
    }
    if not runtime:
        _LOOPBACK["error"] = f"{n_nodes} node(s): no request reported tokens/s"
        return None
    return float(plan["predicted_tokens_per_s"]), statistics.median(runtime)


def loopback_report() -> None:
    """Which constant or node figure would have to change, and by how much, for the predictions to
    match: the compute figures from the 1-node run, then the per-hop cost from the 2-node run
    (links as measured on loopback), checked against the 3-node run."""
    res = _LOOPBACK["results"]
    if 1 not in res or not res[1]["runtime"]:
        return
    from agent.links import LOOPBACK_MBPS, tcp_rtt_ms

    cl = _LOOPBACK.get("cluster")
    rtt = LOOPBACK_RTT_MS
    if cl is not None:
        host_port = cl.ctl.url.rsplit("//", 1)[1]
        host, port = host_port.split(":")
        try:
            rtt = tcp_rtt_ms(host, int(port), samples=9)
        except OSError:
            pass
    loop = Link(rtt_ms=rtt, bandwidth_mbps=LOOPBACK_MBPS)

    def pred(
        n: int, *, compute: float = 1.0, link: Link | None = None, cost: CostModel = DEFAULT_COST
    ) -> float:
        r = res[n]
        return plan_placement(
            r["profile"],
            _scaled_snapshot(r["snap"], compute=compute, link=link),
            r["request"],
            cost=cost,
        ).predicted_tokens_per_s

    meas = {n: statistics.median(r["runtime"]) for n, r in res.items() if r["runtime"]}
    f = _solve(lambda x: pred(1, compute=x), meas[1], 1e-3, 1e3)
    gf, bw = res[1]["figures"][0]
    print("  cost-model check (what would have to change for predicted == measured):")
    if f is None:
        print("    1 node: no scaling of the node's compute figures reproduces the measurement")
        return
    print(
        f"    1 node: the node figures would need x{f:.2f}: gflops {gf:.1f} -> {gf * f:.1f}, "
        f"mem_bandwidth_gbps {bw:.1f} -> {bw * f:.1f} (decode is bandwidth-bound: the agent's numpy benchmark "
        f"{'under' if f > 1 else 'over'}states what llama.cpp gets)"
    )
    for n in sorted(k for k in meas if k > 1):
        as_deployed = float(res[n]["plan"]["predicted_tokens_per_s"])
        with_loop = pred(n, link=loop)
        calibrated = pred(n, compute=f, link=loop)
        print(
            f"    {n} nodes: links unprobed -> scheduler default {DEFAULT_LINK.rtt_ms:g} ms RTT / "
            f"{DEFAULT_LINK.bandwidth_mbps:g} Mbps; "
            f"with loopback probed ({rtt:.3f} ms, {LOOPBACK_MBPS:g} Mbps) "
            f"predicted/measured {with_loop / meas[n]:.2f} "
            f"(deployed {as_deployed / meas[n]:.2f}); "
            f"with the 1-node compute calibration too {calibrated / meas[n]:.2f}"
        )
    if 2 in meas:
        oh = _solve(
            lambda x: -pred(2, compute=f, link=loop, cost=replace(DEFAULT_COST, rpc_overhead_ms=x)),
            -meas[2],
            0.0,
            200.0,
        )
        if oh is None:
            print(
                "    rpc_overhead_ms: no value in [0, 200] ms matches 2 nodes "
                f"(it is {DEFAULT_COST.rpc_overhead_ms} ms now)"
            )
        else:
            line = (
                f"    rpc_overhead_ms would need {oh:.2f} ms per remote node per token "
                f"(now {DEFAULT_COST.rpc_overhead_ms} ms), from the 2-node run"
            )
            if 3 in meas:
                check = pred(
                    3, compute=f, link=loop, cost=replace(DEFAULT_COST, rpc_overhead_ms=oh)
                )
                line += f"; with it, 3 nodes predicted/measured {check / meas[3]:.2f}"
            print(line)
            lo = _solve(
                lambda x: (
                    -pred(2, compute=f, link=loop, cost=replace(DEFAULT_COST, layer_overhead_ms=x))
                ),
                -meas[2],
                0.0,
                50.0,
            )
            if lo is not None:
                print(
                    f"    (or layer_overhead_ms {lo:.3f} ms instead of "
                    f"{DEFAULT_COST.layer_overhead_ms} ms, "
                    "if the extra cost is per layer rather than per hop)"
                )


LOOPBACK_RTT_MS = 0.05


def gpu_beside_ram_case() -> tuple[str, bool]:
    """The picture RACoN exists for: a desktop whose GPU has too little VRAM for the model, beside
    a box with lots of RAM. The plan must use both (GPU layers, RAM for the rest), never ask a
    device for more than its free memory, and match the exhaustive optimum."""
    model = synthetic_profile(
        name="llama-70b", n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672,
        n_vocab=128256,
    )  # fmt: skip
    desk = NodeSnapshot(
        node_id="desktop", name="desktop", state="READY", address="10.0.0.2", rpc_port=50052,
        devices=(
            DeviceSnapshot("desktop", "CPU", "cpu", 12 * GiB, 300.0, 40.0),
            DeviceSnapshot("desktop", "CUDA0", "gpu", 22 * GiB, 40_000.0, 900.0),
        ),
        threads=8,
    )  # fmt: skip
    box = NodeSnapshot(
        node_id="ram-box", name="ram-box", state="READY", address="10.0.0.3", rpc_port=50052,
        devices=(DeviceSnapshot("ram-box", "CPU", "cpu", 120 * GiB, 200.0, 30.0),),
        threads=16,
    )  # fmt: skip
    cluster = ClusterSnapshot(nodes=(desk, box), links={("desktop", "ram-box"): Link(0.3, 1000.0)})
    req = PlacementRequest(n_ctx=2048)
    plan = plan_placement(model, cluster, req)
    best = exhaustive_best(model, cluster, req)
    used = sorted({(d.node_id, d.device) for d in plan.layer_devices})
    fits = all(d.memory_bytes <= d.free_bytes for d in plan.devices)
    both = {"desktop", "ram-box"} <= {n for n, _ in used} and ("desktop", "CUDA0") in used
    ratio = plan.predicted_tokens_per_s / best.predicted_tokens_per_s if best else float("nan")
    layers = ", ".join(
        f"{d.node_id}:{d.device} {d.n_layers}" for d in plan.layer_devices
    )  # fmt: skip
    ok = both and fits and ratio >= QUALITY_WORST_TARGET
    return (
        f"70B (40 GiB) on a 22 GiB GPU desktop + a 120 GiB RAM box: {layers}; "
        f"plan / exhaustive {ratio:.2%}; within free memory: {fits}  {'PASS' if ok else 'FAIL'}",
        ok,
    )


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
    ap.add_argument(
        "--no-loopback", action="store_true", help="skip part 3 (real loopback deployments)"
    )
    ap.add_argument("--loopback-requests", type=int, default=5)
    ap.add_argument("--loopback-warmup", type=int, default=2)
    ap.add_argument("--loopback-max-tokens", type=int, default=128)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for smoke tests (100 clusters, 200-node decisions, 2 loopback requests of 32 tokens)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.clusters, args.big_nodes, args.decisions = (
            min(args.clusters, 100),
            min(args.big_nodes, 200),
            min(args.decisions, 10),
        )
        args.loopback_requests, args.loopback_warmup, args.loopback_max_tokens = 2, 1, 32

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

    print("== a GPU with too little VRAM beside a RAM node ==")
    print(gpu_beside_ram_case()[0])

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
    if args.no_loopback:
        print("not run (--no-loopback)")
    else:
        _LOOPBACK.update(
            requests=args.loopback_requests,
            max_tokens=args.loopback_max_tokens,
            warmup=args.loopback_warmup,
        )
        print(
            f"SmolLM2 spread over 1, 2 and 3 real agents on loopback; measured = the primary's decode tokens/s, "
            f"median of {args.loopback_requests} streamed requests ({args.loopback_max_tokens} tokens, temperature 0) "
            f"after {args.loopback_warmup} warm-up; target error within +-{LOOPBACK_TARGET:.0%}  ({_load()})",
            flush=True,
        )
        try:
            for n in (1, 2, 3):
                m = measure_loopback(n)
                if m is None:
                    print(f"{n} node(s): not run ({_LOOPBACK.get('error', 'unavailable')})")
                    continue
                pred, meas = m
                r = _LOOPBACK["results"][n]
                err = pred / meas - 1
                figures = ", ".join(f"{g:.1f} GFLOPS / {b:.1f} GB/s" for g, b in r["figures"])
                split = "+".join(str(c) for _, c in r["layers"])
                print(
                    f"{n} node(s): predicted/measured {pred / meas:.2f} (error {err:+.0%})  "
                    f"{'PASS' if abs(err) <= LOOPBACK_TARGET else 'FAIL'}  "
                    f"[predicted {pred:.1f} tok/s, measured {meas:.1f} tok/s "
                    f"(client side {statistics.median(r['client']) if r['client'] else float('nan'):.1f}); "
                    f"layers {split}; n_threads {r['plan'].get('n_threads')}; node figures {figures}]",
                    flush=True,
                )
            loopback_report()
        finally:
            close_loopback()
        print(f"  ({_load()})")
    print(f"(quality part took {t_quality:.1f} s)")
    return 0


LOOPBACK_TARGET = 0.30


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average n/a"
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


if __name__ == "__main__":
    raise SystemExit(main())
