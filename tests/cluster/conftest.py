"""The namespace cluster, shared by a module (building it and loading models is the slow part)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import pytest

from tests.smollm2 import smollm2_path

from .harness import (
    Cluster,
    LinkSpec,
    host_profile,
    links_by_name,
    namespace_cluster,
    shared_cpu_benchmark,
    skip_reason,
    wait_for,
)
from .household import (
    HOUSEHOLD,
    JOINED,
    NO_PYTHON,
    HouseholdLan,
    household,
    join_env,
    run_line,
    run_line_without_python,
    start_make_run,
    token_line,
)
from .join_host import build_wheelhouse
from .no_python import build_bundle

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


@pytest.fixture(scope="session")
def household_lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HouseholdLan]:
    """The README's household (issue 24): `BIND=<address> make run` in `controller`, and
    `gpu-desktop`, `ram-box` and `office-pc` (no Python, issue 26) joined with the line
    `racon tokens create` prints, all READY; `intruder` is on the same switch. Shared by the
    session (it takes minutes to build)."""
    build_wheelhouse()
    bundle = build_bundle()  # cached: the agent bundle the controller serves for this platform
    workdir = tmp_path_factory.mktemp("household")
    with household(workdir, HOUSEHOLD) as hh:
        ctl = start_make_run(hh, workdir / "var", smollm2_path())
        t0 = time.monotonic()

        def summary() -> bool:
            if ctl.proc.poll() is not None:
                raise AssertionError(
                    f"make run exited with {ctl.proc.returncode}:\n{ctl.log()[-4000:]}"
                )
            return "[racon] ready" in ctl.log() or "NOT ready" in ctl.log()

        wait_for(summary, 900, "make run's ready summary", interval=1)
        print(f"\nhousehold: make run ready in {time.monotonic() - t0:.0f} s")
        line = token_line(ctl, "household", 3)
        joins, homes, started = {}, {}, {}
        for host in (*JOINED, NO_PYTHON):
            homes[host] = workdir / "homes" / host
            log = workdir / f"join-{host}.log"
            started[host] = time.monotonic()
            if host == NO_PYTHON:
                joins[host] = run_line_without_python(
                    hh, host, line, home=homes[host], log=log, RACON_NODE_NAME=host
                )
            else:
                env = join_env(hh, host, homes[host])
                joins[host] = run_line(hh, host, line, home=homes[host], env=env, log=log)
        ready_after: dict[str, float] = {}

        def all_ready() -> bool:
            for host, proc in joins.items():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"{host}'s join line exited {proc.returncode}:\n"
                        + (workdir / f"join-{host}.log").read_text(errors="replace")[-4000:]
                    )
            rows = ctl.api("GET", "/api/admin/nodes").json()
            rows = rows.get("results", rows) if isinstance(rows, dict) else rows
            states = {n["name"]: n["state"] for n in rows}
            for h in joins:
                if states.get(h) == "READY":
                    ready_after.setdefault(h, time.monotonic() - started[h])
            return all(h in ready_after for h in joins)

        try:
            wait_for(all_ready, 900, f"{', '.join(joins)} READY", interval=1)
        except AssertionError:
            for host in joins:
                print(
                    f"--- join-{host}.log\n"
                    + (workdir / f"join-{host}.log").read_text(errors="replace")[-3000:]
                )
            print("--- make run\n" + ctl.log()[-4000:])
            raise
        print(
            f"household: {', '.join(joins)} joined and READY {time.monotonic() - t0:.0f} s after "
            "make run started; the line to READY: "
            + ", ".join(f"{h} {s:.1f} s" for h, s in ready_after.items())
        )
        try:
            yield HouseholdLan(
                hh=hh, ctl=ctl, line=line, joins=joins, homes=homes, ready_after=ready_after,
                bundle=bundle,
            )  # fmt: skip
        finally:
            print("--- make run (tail)\n" + ctl.log()[-2500:])
