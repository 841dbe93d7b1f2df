"""A split over a Vulkan device on one host and an RPC worker on another (issue 25 item 5): two
network-namespace hosts (tests/cluster/harness.py, the multi-host topology), `vk` lending lavapipe
as Vulkan0 (GGML_VK_VISIBLE_DEVICES=0 in its agent's environment) and `cpu` lending its CPU. A
deployment pinned to both loads with layers on `vk`'s Vulkan0 reached over ggml-rpc from the other
host's primary (an unverified GPU's node is never the primary while another can be), and answers
with the CPU backend's greedy tokens. Tiny: lavapipe is about 36x slower than the CPU build.

Outside CI without the Vulkan build or root, it skips with one line; under CI it fails, naming
the install step (CLARIFICATIONS)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.smollm2 import smollm2_path
from tests.support.lavapipe import (
    N_TOKENS,
    PROMPT,
    cpu_backend_tokens,
    lavapipe_env,
    require_lavapipe,
)

from . import harness
from .harness import OPERATOR_KEY, LinkSpec, host_profile, namespace_cluster, wait_for

pytestmark = [pytest.mark.slow]
MiB = 1 << 20


@pytest.fixture
def gp_prefix(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test's namespaces carry its own prefix (gp-), apart from other sessions' clusters."""
    monkeypatch.setattr(harness, "PREFIX", "gp-racon-")
    yield


def test_a_split_over_vulkan0_on_one_host_and_an_rpc_worker_on_another_serves_cpu_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gp_prefix: None
) -> None:
    reason = harness.skip_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    require_lavapipe()
    model = smollm2_path()
    with namespace_cluster(tmp_path, {"vk": LinkSpec(), "cpu": LinkSpec()}) as cl:
        models = tmp_path / "models"
        models.mkdir()
        try:
            os.link(model, models / model.name)
        except OSError:
            shutil.copy(model, models / model.name)
        tok = cl.post("/api/admin/tokens", {"label": "gpu-split", "max_uses": 2})
        assert tok.status_code == 201, tok.text
        bench = {"gflops": 40.0, "mem_bandwidth_gbps": 10.0}
        cpu_only = host_profile(ram_bytes=1024 * MiB, benchmark=bench)
        with_vk = {
            **cpu_only,
            "gpus": [{"index": 0, "vendor": "mesa", "name": "llvmpipe", "uuid": "Vulkan0",
                      "vram_total": 2048 * MiB, "vram_free": 2048 * MiB, "driver": "mesa",
                      "device": "Vulkan0", "backend": "Vulkan", "software": True}],
        }  # fmt: skip
        with monkeypatch.context() as m:  # the vk agent's environment only (Popen copies it)
            for k, v in lavapipe_env().items():
                m.setenv(k, v)
            cl.start_agent("vk", tok.json()["token"], models_dir=models, profile=with_vk,
                           extra_args=("--max-threads", "1"))  # fmt: skip
        cl.start_agent("cpu", tok.json()["token"], models_dir=models, profile=cpu_only,
                       extra_args=("--max-threads", "1"))  # fmt: skip
        try:
            wait_for(
                lambda: len(cl.get("/api/admin/nodes?state=READY").json()) == 2, 120, "2 READY"
            )
            reg = cl.post("/api/admin/models", {"path": str(models / model.name), "name": "sm"})
            assert reg.status_code == 201, reg.text
            pin = {
                "model": "sm",
                "n_ctx": 256,
                "n_parallel": 1,
                "devices": ["vk:Vulkan0", "cpu:CPU"],
            }
            plan = cl.post("/api/admin/deployments/preview", pin)
            assert plan.status_code == 200, plan.text
            got = plan.json()
            used = {(d["node_name"], d["device"]) for d in got["devices"] if d["n_layers"]}
            assert ("vk", "Vulkan0") in used and got["primary_name"] == "cpu", got
            dep = cl.post("/api/admin/deployments", pin)
            assert dep.status_code == 202, dep.text
            dep_id = dep.json()["id"]

            def ready() -> dict[str, Any] | None:
                d = cl.get(f"/api/admin/deployments/{dep_id}").json()
                assert d["state"] not in ("FAILED", "STOPPED"), (d, cl.logs()[-3000:])
                return d if d["state"] == "READY" else None

            # Mesa compiles its shaders on the first load (tens of seconds on a shared machine).
            detail = wait_for(ready, 420, "the Vulkan0 + RPC split READY")
            log = detail["load_report"]["load_log"]
            # The primary on `cpu` reaches vk's worker as RPC devices: its CPU and its Vulkan0.
            rpc_lines = [ln for ln in log if "RPC" in ln and "model buffer size" in ln]
            assert rpc_lines, log
            resp = httpx.post(
                cl.url + "/v1/completions",
                headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                json={"model": "sm", "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0},
                timeout=300,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == cpu_backend_tokens(model)
        except AssertionError:
            print(cl.logs()[-3000:], *(h.log()[-3000:] for h in cl.hosts.values()))
            raise
        finally:
            cl.stop_agents()


def test_stale_gp_namespaces_are_swept_and_a_live_runs_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cleanup_stale sweeps this test's "gp-racon-" namespaces too when their owner is gone (a
    killed run), and never a live run's, whatever the prefix. `ip` is stood in for: this needs no
    root and touches no real namespace."""
    dead = 2**22 + 12345  # above Linux's largest pid_max (2**22): no such process
    while harness._pid_alive(dead):
        dead += 1
    owners = tmp_path / "owners"
    owners.mkdir()
    (owners / "0badc0de.pid").write_text(str(dead))
    (owners / "1badc0de.pid").write_text(str(dead))
    (owners / "c0ffee00.pid").write_text(str(os.getpid()))
    listed = [
        "gp-racon-0badc0de-h1 (id: 3)", "gp-racon-0badc0de-h2 (id: 4)",  # stale
        "racon-1badc0de-h1",  # stale, the default prefix
        "gp-racon-c0ffee00-h1", "racon-c0ffee00-h2",  # live
        "gp-racon-abcdef12-h1",  # no owner file: a run killed before it wrote one
        "racon-hh-0badc0de-h1", "other-0badc0de-h1",  # not the harness's
    ]  # fmt: skip
    deleted: list[str] = []

    def fake_sh(*argv: str, check: bool = True) -> Any:
        if argv[:3] == ("ip", "netns", "del"):
            deleted.append(argv[3])
        out = "\n".join(listed) if argv[:3] == ("ip", "netns", "list") else ""
        return type("Done", (), {"stdout": out, "returncode": 0})()

    monkeypatch.setattr(harness, "sh", fake_sh)
    monkeypatch.setattr(harness, "OWNERS", owners)
    removed = harness.cleanup_stale()
    assert removed == deleted == [
        "gp-racon-0badc0de-h1", "gp-racon-0badc0de-h2", "racon-1badc0de-h1",
        "gp-racon-abcdef12-h1",
    ]  # fmt: skip
    assert (owners / "c0ffee00.pid").exists() and not (owners / "0badc0de.pid").exists()
