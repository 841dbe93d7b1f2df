"""The namespace cluster, shared by a module (building it and loading models is the slow part)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.smollm2 import smollm2_path

from .harness import (
    Cluster,
    LinkSpec,
    host_profile,
    namespace_cluster,
    shared_cpu_benchmark,
    skip_reason,
    wait_for,
)

# Each host lends 200 MiB: SmolLM2 at n_ctx 512 needs about 300 MiB, so every plan is a split.
HOST_RAM = 200 << 20
SLOW = LinkSpec(delay_ms=50, rate_mbit=10)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = skip_reason()
    for item in items:
        if "tests/cluster" in str(item.path):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.e2e)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def links_by_name(cl: Cluster) -> dict[tuple[str, str], dict[str, Any]]:
    ids = {v: k for k, v in cl.node_ids().items()}
    r = redis.Redis.from_url(cl.redis_url, decode_responses=True)
    out = {}
    for pair, raw in r.hgetall("racon:links").items():
        a, _, b = pair.partition("|")
        if a in ids and b in ids:
            out[(ids[a], ids[b])] = json.loads(raw)
    return out


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """fast1, fast2 (LAN) and slow (10 Mbit/s, 50 ms each way), SmolLM2 registered, links measured."""
    workdir = tmp_path_factory.mktemp("cluster3")
    t0 = time.monotonic()
    with namespace_cluster(
        workdir, {"fast1": LinkSpec(), "fast2": LinkSpec(), "slow": SLOW},
        LINK_PROBE_INTERVAL_SECONDS="10",
    ) as cl:  # fmt: skip
        models = workdir / "models"
        models.mkdir()
        model = smollm2_path()
        try:
            os.link(model, models / model.name)
        except OSError:
            shutil.copy(model, models / model.name)
        tok = cl.post("/api/admin/tokens", {"label": "cluster", "max_uses": 3})
        assert tok.status_code == 201, tok.text
        # What the predictions rest on: measured on these shared cores with the controller, its
        # worker and the wire up, as the median of short runs (one sample swings several-fold).
        bench = shared_cpu_benchmark()
        for name in cl.hosts:
            cl.start_agent(
                name,
                tok.json()["token"],
                models_dir=models,
                profile=host_profile(ram_bytes=HOST_RAM, benchmark=bench),
                # One thread each: the hosts share this machine's cores, and an engine with a
                # thread per core stalls 2-20x whenever another host's process runs (measured;
                # the reason in test (b)). The planner lends the benchmark's share for the cap.
                extra_args=("--max-threads", "1"),
            )
        try:
            wait_for(
                lambda: len(cl.get("/api/admin/nodes?state=READY").json()) == 3, 120, "3 READY"
            )
            reg = cl.post(
                "/api/admin/models", {"path": str(models / model.name), "name": "smollm2"}
            )
            assert reg.status_code == 201, reg.text
            # The first probes run while three agents start on two cores: wait for a quiet round.
            wait_for(
                lambda: (
                    len(lk := links_by_name(cl)) == 6
                    and max(lk[("fast1", "fast2")]["rtt_ms"], lk[("fast2", "fast1")]["rtt_ms"]) < 20
                ),
                120,
                "every link measured both ways, the LAN pair in a quiet round",
            )
        except AssertionError:
            print(cl.logs(), *(h.log()[-3000:] for h in cl.hosts.values()))
            raise
        print(f"\ncluster up in {time.monotonic() - t0:.1f} s; benchmark {bench}")
        yield cl
