"""The GPU path for real, without a GPU (issue 25): llama.cpp's Vulkan backend on Mesa's lavapipe,
a software Vulkan device on the CPU (FACTS.md, "A GPU backend without a GPU").

A real controller and real `node-agent` processes: the agent reads ggml's devices and enrolls with
a `Vulkan0` GPU and its memory; a deployment pinned to `Vulkan0` loads there (asserted on the
device lines of llama.cpp's own load log at -lv 4, never on "offloaded N layers", which a CPU run
prints too) and answers with the CPU backend's greedy tokens; a fake GPU claim is planned at the
floor and never becomes the primary. lavapipe is about 36x slower than the CPU build: a handful of
tokens, one Vulkan-backed deployment.

Outside CI without the Vulkan packages and build these skip with one line; under CI they fail,
naming the install step (CLARIFICATIONS)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.lavapipe import (
    N_TOKENS,
    PROMPT,
    cpu_backend_tokens,
    lavapipe_env,
    models_dir_with,
    ready_nodes,
    require_lavapipe,
    start_named_agent,
)

from .harness import Controller, consumer_headers, stop_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MiB = 1 << 20


@pytest.fixture
def vulkan_node(
    controller: Controller,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    django_db_blocker: Any,
) -> Iterator[tuple[Controller, dict[str, Any], str, Path]]:
    """One agent lending lavapipe as Vulkan0, READY, and SmolLM2 registered as a model of its own
    (one Vulkan-backed agent per run: the tests below share it inside one test, since the e2e
    database is flushed between tests)."""
    require_lavapipe()
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as monkeypatch:
        workdir = tmp_path_factory.mktemp("lavapipe")
        models = models_dir_with(workdir, model_path)
        agent = start_named_agent(
            controller, "vk-host", workdir, models, monkeypatch, env=lavapipe_env()
        )
        try:
            nodes = wait_for(lambda: ready_nodes(controller, {"vk-host"}), 120, "vk-host READY")
            created = controller.post(
                "/api/admin/models", {"path": str(model_path), "name": "smollm2-vk"}
            )
            assert created.status_code == 201, created.text
            yield controller, nodes["vk-host"], "smollm2-vk", workdir
        finally:
            stop_agent(agent)


def _deploy(ctl: Controller, request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    dep = ctl.post("/api/admin/deployments", request)
    assert dep.status_code == 202, dep.text
    dep_id = dep.json()["id"]

    def loaded() -> dict[str, Any] | None:
        d = ctl.get(f"/api/admin/deployments/{dep_id}").json()
        assert d["state"] not in ("FAILED", "STOPPED"), d
        return d if d["state"] == "READY" else None

    # The first start compiles Mesa's shaders (17-40 s measured here), on a shared machine.
    return dep_id, wait_for(loaded, 420, "the Vulkan deployment READY")


def _complete(ctl: Controller, model: str) -> str:
    resp = httpx.post(
        ctl.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0},
        headers=consumer_headers(f"vk-consumer-{os.urandom(3).hex()}"),
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def test_vulkan0_is_lent_runs_a_pinned_deployment_and_a_split_with_an_rpc_worker(
    vulkan_node: tuple[Controller, dict[str, Any], str, Path],
    model_path: Path,
    django_db_blocker: Any,
) -> None:
    from apps.nodes.models import Node

    ctl, node, model, _ = vulkan_node
    # The real agent read ggml's devices: lavapipe as Vulkan0 with its (fixed) 2048 MiB.
    gpus = Node.objects.get(name="vk-host").hardware["gpus"]
    assert [(g["device"], g["backend"], g["vram_total"]) for g in gpus] == [
        ("Vulkan0", "Vulkan", 2048 * MiB)
    ], gpus
    # Unpinned, the scheduler leaves the unverified (and slow) device out.
    free = ctl.post("/api/admin/deployments/preview", {"model": model, "n_ctx": 256})
    assert free.status_code == 200, free.text
    assert [d["device"] for d in free.json()["devices"] if d["n_layers"]] == ["CPU"]
    # Pinned: every layer on Vulkan0, within its free memory, with a predicted rate per device.
    pin = {"model": model, "n_ctx": 256, "n_parallel": 1, "devices": ["vk-host:Vulkan0"]}
    preview = ctl.post("/api/admin/deployments/preview", pin)
    assert preview.status_code == 200, preview.text
    rows = {d["device"]: d for d in preview.json()["devices"]}
    assert rows["Vulkan0"]["n_layers"] == 30 and rows.get("CPU", {}).get("n_layers", 0) == 0
    assert 0 < rows["Vulkan0"]["memory_bytes"] <= rows["Vulkan0"]["free_bytes"]
    assert rows["Vulkan0"]["tokens_per_s"] > 0
    dep_id, detail = _deploy(ctl, pin)
    log = detail["load_report"]["load_log"]
    vk_model = [line for line in log if "Vulkan0 model buffer size" in line]
    assert vk_model, log  # llama.cpp's -lv 4 device line: the weights are on the Vulkan device
    assert float(vk_model[0].split("=")[1].split()[0]) > 50, vk_model  # SmolLM2: ~92 MiB there
    assert any("Vulkan0 KV buffer size" in line for line in log), log
    try:
        on_vulkan = _complete(ctl, model)
        assert on_vulkan and on_vulkan == cpu_backend_tokens(model_path), on_vulkan
    finally:
        ctl.post(f"/api/admin/deployments/{dep_id}/stop")
    # The same Vulkan-backed agent, now as the RPC worker of a split (Mesa's shaders are cached).
    split_over_vulkan0_and_an_rpc_worker(vulkan_node, model_path, django_db_blocker)


def split_over_vulkan0_and_an_rpc_worker(
    vulkan_node: tuple[Controller, dict[str, Any], str, Path],
    model_path: Path,
    django_db_blocker: Any,
) -> None:
    """Vulkan0 of the lavapipe host and the CPU of a second agent, pinned: the verified CPU host
    is the primary and the Vulkan host serves Vulkan0 through its ggml-rpc worker (RPC1, after its
    CPU), so llama.cpp's load log shows the layers on both RPC devices and nothing on the
    primary's own CPU beyond the embeddings."""
    ctl, _, model, workdir = vulkan_node
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as monkeypatch:
        models = workdir / "models"
        other = start_named_agent(ctl, "rpc-host", workdir, models, monkeypatch)
        try:
            wait_for(lambda: ready_nodes(ctl, {"vk-host", "rpc-host"}), 120, "rpc-host READY")
            pin = {
                "model": model,
                "n_ctx": 256,
                "n_parallel": 1,
                "devices": ["vk-host:Vulkan0", "rpc-host:CPU"],
                "allow_same_node": True,
            }
            preview = ctl.post("/api/admin/deployments/preview", pin)
            assert preview.status_code == 200, preview.text
            plan = preview.json()
            used = {(d["node_name"], d["device"]) for d in plan["devices"] if d["n_layers"]}
            assert ("vk-host", "Vulkan0") in used and plan["primary_name"] == "rpc-host", plan
            dep_id, detail = _deploy(ctl, pin)
            try:
                log = detail["load_report"]["load_log"]
                assert any("RPC" in line and "model buffer size" in line for line in log), log
                assert _complete(ctl, model) == cpu_backend_tokens(model_path)
            finally:
                ctl.post(f"/api/admin/deployments/{dep_id}/stop")
        finally:
            stop_agent(other)


def test_a_fake_gpu_claim_is_planned_at_the_floor_and_never_the_primary(
    controller: Controller,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    django_db_blocker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No Vulkan needed: a hardware profile claims an 80 GiB, 900 TFLOPS CUDA0 nobody verified."""
    with django_db_blocker.unblock():
        workdir = tmp_path_factory.mktemp("fakegpu")
        models = models_dir_with(workdir, model_path)
        profile = workdir / "fake.json"
        profile.write_text(json.dumps({
            "cpu": {"model": "x", "physical_cores": 2, "logical_cores": 2, "flags": []},
            "memory": {"total": 16 << 30, "available": 12 << 30},
            "benchmark": {"gflops": 40.0, "mem_bandwidth_gbps": 10.0},
            "gpus": [{"index": 0, "vendor": "nvidia", "name": "H100 (claimed)", "uuid": "GPU-fake",
                      "vram_total": 80 << 30, "vram_free": 80 << 30, "driver": "x",
                      "device": "CUDA0", "backend": "CUDA",
                      "gflops": 900_000.0, "mem_bandwidth_gbps": 3_000.0}],
        }))  # fmt: skip
        agents = [
            start_named_agent(controller, "fake-gpu", workdir, models, monkeypatch,
                   extra=["--hardware-profile", str(profile)]),
            start_named_agent(controller, "honest-cpu", workdir, models, monkeypatch),
        ]  # fmt: skip
        try:
            wait_for(lambda: ready_nodes(controller, {"fake-gpu", "honest-cpu"}), 120, "both READY")
            created = controller.post(
                "/api/admin/models", {"path": str(model_path), "name": "smollm2-fake"}
            )
            assert created.status_code == 201, created.text
            body = {"model": "smollm2-fake", "n_ctx": 256, "nodes": ["fake-gpu", "honest-cpu"]}
            # Left to itself, the scheduler never makes the fake node the primary.
            plan = controller.post("/api/admin/deployments/preview", body)
            assert plan.status_code == 200, plan.text
            assert plan.json()["primary_name"] == "honest-cpu", plan.json()
            # Its GPU pinned beside the honest node: used, at the floor, and still not primary.
            pinned = {**body, "devices": ["fake-gpu:CUDA0", "honest-cpu:CPU"]}
            plan = controller.post("/api/admin/deployments/preview", pinned)
            assert plan.status_code == 200, plan.text
            got = plan.json()
            assert got["primary_name"] == "honest-cpu", got
            (gpu,) = [d for d in got["devices"] if d["device"] == "CUDA0"]
            assert gpu["n_layers"] > 0 and gpu["gflops"] < 900_000.0 / 1000
            assert gpu["gflops"] <= 40.0 and gpu["mem_bandwidth_gbps"] <= 10.0  # the floor
        finally:
            for agent in agents:
                stop_agent(agent)
