"""GPU claims timed on the GPU, for real (issue 25 item 4): real `node-agent` processes lend
lavapipe as Vulkan0, and the controller's two-phase challenge has the agent's own llama.cpp build
(a child of the agent) prepare the seeded inputs on Vulkan0 untimed, times only the step from a
fresh nonce to the digest of the nonce's product, and checks the revealed product against the
digest and with Freivalds' algorithm. An honest node passes at its measured figure; a node claiming 900 TFLOPS for the
same device answers correctly, far too late for its claim, and fails with an event naming both
figures. Products stay tiny: lavapipe is about 36x slower than the CPU build.

The challenge is called here, in the test process, as the controller's Celery task calls it
(apps.jobs.tasks.gpu_challenge), so its sizes can be the test's; the commands go through the live
controller's Redis queue and the answers come back through its HTTP API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from racon import ids
from tests.support.lavapipe import lavapipe_env, ready_nodes, require_lavapipe, start_named_agent

from .harness import Controller, stop_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MiB = 1 << 20


def fake_claim_profile(path: Path) -> Path:
    """The lavapipe device, claimed at 900 TFLOPS (its figures otherwise as ggml reports them)."""
    path.write_text(json.dumps({
        "cpu": {"model": "x", "physical_cores": 2, "logical_cores": 2, "flags": []},
        "memory": {"total": 16 << 30, "available": 12 << 30},
        "benchmark": {"gflops": 40.0, "mem_bandwidth_gbps": 10.0},
        "gpus": [{"index": 0, "vendor": "mesa", "name": "llvmpipe (claimed H100)",
                  "uuid": "Vulkan0", "vram_total": 2048 * MiB, "vram_free": 2048 * MiB,
                  "driver": "x", "device": "Vulkan0", "backend": "Vulkan", "software": True,
                  "gflops": 900_000.0, "mem_bandwidth_gbps": 3_000.0}],
    }))  # fmt: skip
    return path


def test_lavapipe_challenge_verifies_an_honest_node_and_fails_a_900_tflops_claim(
    controller: Controller,
    tmp_path_factory: pytest.TempPathFactory,
    django_db_blocker: Any,
    settings: Any,
) -> None:
    from apps.jobs.selectors import gpu_verified
    from apps.nodes.gpu_challenges import node_gpu_challenge
    from apps.nodes.models import Event, Node

    require_lavapipe()
    # Commands are signed with the live controller's key. The answer has the default's full size
    # (1024x1024 residues: 1 MiB in the agent's report), the work stays tiny (k = 16).
    settings.SECRET_KEY = controller.env["SECRET_KEY"]
    settings.GPU_CHALLENGE_MAX_SIDE, settings.GPU_CHALLENGE_MAX_K = 1024, 16
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as monkeypatch:
        workdir = tmp_path_factory.mktemp("gpu-challenge")
        models = workdir / "models"
        models.mkdir()
        profile = fake_claim_profile(workdir / "fake.json")
        agents = [
            start_named_agent(controller, "vk-honest", workdir, models, monkeypatch, env=lavapipe_env()),
            start_named_agent(controller, "vk-claims", workdir, models, monkeypatch, env=lavapipe_env(),
                   extra=["--hardware-profile", str(profile)]),
        ]  # fmt: skip
        try:
            wait_for(lambda: ready_nodes(controller, {"vk-honest", "vk-claims"}), 120, "both READY")
            honest = Node.objects.get(name="vk-honest")
            assert [g["device"] for g in honest.hardware["gpus"]] == ["Vulkan0"]
            verdict = node_gpu_challenge(node_id=ids.node_id(honest.id), now=timezone.now())
            assert verdict.outcome == "verified", verdict
            assert verdict.device == "Vulkan0" and verdict.credited == verdict.measured > 0
            honest.refresh_from_db()
            assert gpu_verified(honest.hardware["gpus"][0])
            event = Event.objects.get(node=honest, kind="GPU_SPEED_VERIFIED")
            assert event.data["correct"] is True and (event.data["m"], event.data["k"]) == (
                1024,
                16,
            )
            # Two phases: the inputs' making and upload (prepare) are outside the timed step.
            assert event.data["prepare_seconds"] > 0 and event.data["seconds"] > 0, event.data

            claims = Node.objects.get(name="vk-claims")
            verdict = node_gpu_challenge(node_id=ids.node_id(claims.id), now=timezone.now())
            assert verdict.outcome == "failed" and verdict.measured > 0, verdict  # right, late
            claims.refresh_from_db()
            assert not gpu_verified(claims.hardware["gpus"][0])  # still planned at the floor
            event = Event.objects.get(node=claims, kind="GPU_CHALLENGE_FAILED")
            assert "900000.0 GFLOPS claimed" in event.message, event.message
            assert f"{verdict.measured} GFLOPS measured" in event.message, event.message
            assert event.data["correct"] is True
        finally:
            for agent in agents:
                stop_agent(agent)
