"""Multi-host benchmark on the namespace cluster (tests/cluster/harness.py); needs root.

Run: ``sudo .venv/bin/python bench/multihost.py [--runs 2]``.

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

from agent.hardware.benchmark import run_benchmarks  # noqa: E402
from tests.cluster.harness import (  # noqa: E402
    LinkSpec,
    host_profile,
    namespace_cluster,
    skip_reason,
    wait_for,
)
from tests.cluster.test_multihost import N_CTX, decode_rate  # noqa: E402
from tests.smollm2 import smollm2_path  # noqa: E402

SHAPES = (("fast1", "fast2"), ("fast1", "slow"), ("fast1", "fast2", "slow"))


def placement_quality(env: dict[str, str]) -> None:
    # Django is set up only now, on the cluster controller's database and Redis.
    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "racon.settings"
    import django  # noqa: PLC0415 - configured for the cluster's controller above

    django.setup()
    from apps.jobs import selectors  # noqa: PLC0415
    from apps.jobs.scheduler import PlacementRequest, plan_placement  # noqa: PLC0415
    from apps.jobs.scheduler.reference import exhaustive_best  # noqa: PLC0415
    from apps.jobs.services import scheduler_cost_model  # noqa: PLC0415
    from apps.models_repo.models import ModelFile  # noqa: PLC0415
    from apps.models_repo.profile import ModelProfile  # noqa: PLC0415

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
    print(f"  exhaustive optimum: {nodes(best)} {best.predicted_tokens_per_s:.2f} tok/s")
    print(f"  quality (scheduler / optimum, predicted): {ratio:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="racon-multihost-bench-"))
    bench = run_benchmarks()
    rows = []
    try:
        with namespace_cluster(
            workdir, {"fast1": LinkSpec(), "fast2": LinkSpec(), "slow": LinkSpec(delay_ms=50, rate_mbit=10)}
        ) as cl:  # fmt: skip
            models = workdir / "models"
            models.mkdir()
            model = smollm2_path()
            shutil.copy(model, models / model.name)
            tok = cl.post("/api/admin/tokens", {"label": "bench", "max_uses": 3}).json()["token"]
            for name in cl.hosts:
                cl.start_agent(
                    name,
                    tok,
                    models_dir=models,
                    profile=host_profile(ram_bytes=200 << 20, benchmark=bench),
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
            time.sleep(15)  # the join probes
            for shape in SHAPES:
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
                    rows.append((shape, None, None, f"not loaded: {exc}"))
                    continue
                load_s = time.monotonic() - t0
                if d["state"] != "READY":
                    rows.append((shape, None, None, "FAILED"))
                    continue
                predicted = float(d["plan"]["predicted_tokens_per_s"])
                decode_rate(cl)
                measured = statistics.median(decode_rate(cl) for _ in range(args.runs))
                rows.append((shape, predicted, measured, f"loaded in {load_s:.0f} s"))
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
            for shape, pred, meas, note in rows:
                ratio = f"{meas / pred:6.2f}" if pred and meas else "     -"
                print(f"  {'+'.join(shape):28} {pred or 0:10.2f} {meas or 0:10.2f} {ratio}  {note}")
            placement_quality(cl.env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
