"""Multi-host benchmark on the namespace cluster (tests/cluster/harness.py); needs root.

Run: ``sudo .venv/bin/python bench/multihost.py [--runs 2] [--quick]``. ``--quick`` measures two
shapes (fast1+fast2, fast1+slow) with one timed request each, about 5-8 minutes on two busy cores.

Three hosts: fast1 and fast2 on a LAN, slow behind 10 Mbit/s and 50 ms each way; each lends
200 MiB so SmolLM2 must split. For each plan shape (fast1+fast2, fast1+slow, spread over all
three) it loads a real deployment, asks for streamed completions at temperature 0 and prints the
predicted against the measured decode tokens/s, side by side with their ratio. Then placement
quality on the measured cluster: the scheduler's plan against the exhaustive optimum
(apps.jobs.scheduler.reference.exhaustive_best), both computed in this process on the
controller's own database and Redis. Bounded: every load waits at most 240 s, every request 180 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster.conftest import links_by_name  # noqa: E402
from tests.cluster.harness import (  # noqa: E402
    LinkSpec,
    host_profile,
    namespace_cluster,
    shared_cpu_benchmark,
    skip_reason,
    wait_for,
)
from tests.cluster.test_multihost import N_CTX, decode_rate  # noqa: E402
from tests.smollm2 import smollm2_path  # noqa: E402

SHAPES = (("fast1", "fast2"), ("fast1", "slow"), ("fast1", "fast2", "slow"))
Row = tuple[tuple[str, ...], float | None, float | None, str, dict[str, float] | None]


def placement_quality(env: dict[str, str], rows: list[Row], bench: dict[str, float]) -> None:
    # Django is set up only now, on the cluster controller's database and Redis.
    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "racon.settings"
    import django  # configured for the cluster's controller above

    django.setup()
    from apps.jobs import selectors
    from apps.jobs.deployments import scheduler_cost_model
    from apps.jobs.scheduler import PlacementRequest, plan_placement
    from apps.jobs.scheduler.reference import exhaustive_best
    from apps.models_repo.models import ModelFile
    from apps.models_repo.profile import ModelProfile

    mf = ModelFile.objects.order_by("-created_at").first()
    assert mf is not None
    profile = ModelProfile.from_dict(mf.profile)
    snap = selectors.cluster_snapshot(model_file=mf)
    req = PlacementRequest(n_ctx=N_CTX, n_parallel=1)
    cost = scheduler_cost_model()
    t0 = time.perf_counter()
    chosen = plan_placement(profile, snap, req, cost=cost)
    t_search = time.perf_counter() - t0
    best = exhaustive_best(profile, snap, req, cost=cost)
    names = {n.node_id: n.name for n in snap.nodes}

    def nodes(p: Any) -> str:
        return "+".join(sorted({names[d.node_id] for d in p.devices}))

    # The same shapes predicted again with the benchmark measured around each one's requests:
    # each device's figure (the enrolled benchmark as the scheduler scaled it: measured
    # efficiency, the lent thread share) scaled by the fresh benchmark over the enrolled one.
    ids = {n.name: n.node_id for n in snap.nodes}
    print("\n== the same shapes, predicted with the benchmark measured around their requests ==")
    print(
        f"  {'shape':24} {'bench GFLOPS':>12} {'GB/s':>6} {'predicted':>10} {'measured':>10} {'ratio':>6}"
    )
    for shape, _pred, meas, _note, fresh in rows:
        if not fresh or not meas:
            continue
        fresh_snap = dataclasses.replace(
            snap,
            nodes=tuple(
                dataclasses.replace(
                    n,
                    devices=tuple(
                        dataclasses.replace(
                            d,
                            gflops=d.gflops * fresh["gflops"] / bench["gflops"],
                            mem_bandwidth_gbps=d.mem_bandwidth_gbps
                            * fresh["mem_bandwidth_gbps"]
                            / bench["mem_bandwidth_gbps"],
                        )
                        for d in n.devices
                    ),
                )
                for n in snap.nodes
            ),
        )  # fmt: skip
        pinned = dataclasses.replace(req, pin_nodes=tuple(ids[x] for x in shape), spread=True)
        again = plan_placement(profile, fresh_snap, pinned, cost=cost).predicted_tokens_per_s
        print(f"  {'+'.join(shape):24} {fresh['gflops']:12.2f} {fresh['mem_bandwidth_gbps']:6.2f} "
              f"{again:10.2f} {meas:10.2f} {meas / again:6.2f}")  # fmt: skip

    print("\n== placement quality on the measured cluster ==")
    for (a, b), lk in sorted(
        snap.links.items(), key=lambda kv: (names.get(kv[0][0], ""), names.get(kv[0][1], ""))
    ):
        print(
            f"  link {names.get(a, a)}->{names.get(b, b)}: {lk.rtt_ms:.1f} ms, {lk.bandwidth_mbps:.1f} Mbit/s"
        )
    ratio = chosen.predicted_tokens_per_s / best.predicted_tokens_per_s
    print(
        f"  scheduler: {nodes(chosen)} {chosen.predicted_tokens_per_s:.2f} tok/s ({t_search * 1000:.1f} ms)"
    )
    for line in chosen.explanation:
        print("     ", line)
    print(f"  exhaustive optimum: {nodes(best)} {best.predicted_tokens_per_s:.2f} tok/s")
    print(f"  quality (scheduler / optimum, predicted): {ratio:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=2, help="timed requests per shape (median)")
    p.add_argument("--quick", action="store_true", help="two shapes, one timed request each")
    p.add_argument(
        "--threads", type=int, default=1, help="threads each host lends (--max-threads; >= 1)"
    )
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    shapes = SHAPES[:2] if args.quick else SHAPES
    runs = 1 if args.quick else args.runs
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="racon-multihost-bench-"))
    rows: list[Row] = []
    try:
        with namespace_cluster(
            workdir, {"fast1": LinkSpec(), "fast2": LinkSpec(), "slow": LinkSpec(delay_ms=50, rate_mbit=10)},
            LINK_PROBE_INTERVAL_SECONDS="10",
        ) as cl:  # fmt: skip
            models = workdir / "models"
            models.mkdir()
            model = smollm2_path()
            shutil.copy(model, models / model.name)
            tok = cl.post("/api/admin/tokens", {"label": "bench", "max_uses": 3}).json()["token"]
            bench = shared_cpu_benchmark()  # with the controller, its worker and the wire up
            for name in cl.hosts:
                cl.start_agent(
                    name,
                    tok,
                    models_dir=models,
                    profile=host_profile(ram_bytes=200 << 20, benchmark=bench),
                    # The hosts share this machine's cores (tests/cluster/conftest.py says why).
                    extra_args=("--max-threads", str(args.threads)),
                )
            wait_for(
                lambda: len(cl.get("/api/admin/nodes?state=READY").json()) == 3, 120, "3 READY"
            )
            assert (
                cl.post(
                    "/api/admin/models", {"path": str(models / model.name), "name": "smollm2"}
                ).status_code
                == 201
            )
            # The first probes run while three agents start on two cores: wait for a quiet round.
            wait_for(
                lambda: (
                    len(lk := links_by_name(cl)) == 6
                    and max(lk[("fast1", "fast2")]["rtt_ms"], lk[("fast2", "fast1")]["rtt_ms"]) < 20
                ),
                120,
                "every link measured both ways, the LAN pair in a quiet round",
            )
            for shape in shapes:
                dep = cl.post("/api/admin/deployments", {"model": "smollm2", "nodes": list(shape),
                                                        "spread": True, "n_ctx": N_CTX, "n_parallel": 1})  # fmt: skip
                dep_id = dep.json()["id"]
                t0 = time.monotonic()
                try:
                    d = wait_for(
                        lambda dep_id=dep_id: (
                            (x := cl.get(f"/api/admin/deployments/{dep_id}").json())["state"]
                            in ("READY", "FAILED")
                            and x
                        ),
                        240,
                        f"{shape} to load",
                    )
                except AssertionError as exc:
                    rows.append((shape, None, None, f"not loaded: {exc}", None))
                    continue
                load_s = time.monotonic() - t0
                if d["state"] != "READY":
                    rows.append((shape, None, None, "FAILED", None))
                    continue
                predicted = float(d["plan"]["predicted_tokens_per_s"])
                decode_rate(cl)
                before = shared_cpu_benchmark(3)
                measured = statistics.median(decode_rate(cl) for _ in range(runs))
                after = shared_cpu_benchmark(3)
                fresh = {k: statistics.median((before[k], after[k])) for k in before}
                note = (f"loaded in {load_s:.0f} s; benchmark around the requests "
                        f"{before['gflops']:.1f}/{after['gflops']:.1f} GFLOPS")  # fmt: skip
                rows.append((shape, predicted, measured, note, fresh))
                cl.post(f"/api/admin/deployments/{dep_id}/stop")
                wait_for(
                    lambda dep_id=dep_id: (
                        cl.get(f"/api/admin/deployments/{dep_id}").json()["state"] == "STOPPED"
                    ),
                    60,
                    "stop",
                )
            print(f"\n== predicted vs measured decode tokens/s (benchmark {bench}) ==")
            print(f"  {'shape':28} {'predicted':>10} {'measured':>10} {'ratio':>6}")
            for row_shape, pred, meas, note, _ in rows:
                ratio = f"{meas / pred:6.2f}" if pred and meas else "     -"
                print(
                    f"  {'+'.join(row_shape):28} {pred or 0:10.2f} {meas or 0:10.2f} {ratio}  {note}"
                )
            placement_quality(cl.env, rows, bench)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
