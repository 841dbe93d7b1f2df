"""The deploy form's engine (issue 30): the operator picks llama.cpp or vLLM, or leaves it to the
scheduler, whose preview says which engine and why; vLLM for a GGUF-only model is refused, naming
why."""

from __future__ import annotations

from typing import Any

from django.test import Client

from apps.jobs.models import Deployment
from apps.models_repo.models import Model
from apps.models_repo.profile import synthetic_profile
from tests.factories import ModelFactory, ModelFileFactory, NodeFactory, hardware_profile


def _model(*, directory: bool) -> Model:
    m = ModelFactory(name="smol-ui")
    tiny = synthetic_profile(
        name="tiny", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152
    )
    ModelFileFactory(
        model=m, file_name="m.gguf", size=100 * 1024**2, n_layer=30, profile=tiny.to_dict()
    )
    if directory:
        ModelFileFactory(
            model=m,
            file_name="smol-st",
            format="safetensors",
            quantization="bfloat16",
            size=270_000_000,
            n_layer=30,
            n_embd=576,
            n_head=9,
            n_head_kv=3,
        )
    NodeFactory(name="vl-box", hardware={**hardware_profile(), "engines": ["llamacpp", "vllm"]})
    return m


def test_the_form_offers_the_engines(staff_client: Client, world: Any) -> None:
    body = staff_client.get("/deployments/").content.decode()
    assert '<select name="engine">' in body
    assert '<option value="">Scheduler\'s choice</option>' in body
    assert '<option value="vllm">' in body and '<option value="llamacpp">' in body


def test_the_preview_says_which_engine_and_why(staff_client: Client, world: Any) -> None:
    _model(directory=True)
    form = {"model": "smol-ui", "n_ctx": "512", "n_parallel": "8", "nodes": []}
    resp = staff_client.post("/deployments/preview", {**form, "engine": ""})
    body = resp.content.decode()
    assert resp.status_code == 200, body
    assert "engine <b>vllm</b>" in body and "the scheduler" in body and "concurrent streams" in body
    one = staff_client.post("/deployments/preview", {**form, "n_parallel": "1", "engine": ""})
    assert "engine <b>llamacpp</b>" in one.content.decode()
    assert "faster per stream" in one.content.decode()
    named = staff_client.post("/deployments/preview", {**form, "engine": "llamacpp"})
    assert "engine <b>llamacpp</b>" in named.content.decode()
    # Deployed from the form with the engine left empty: the scheduler's vLLM.
    staff_client.post("/deployments/", {**form, "engine": ""}, headers={"HX-Request": "true"})
    dep = Deployment.objects.get(model__name="smol-ui")
    assert dep.engine == "vllm" and dep.model_file.format == "safetensors"


def test_vllm_for_a_gguf_only_model_is_refused_naming_why(staff_client: Client, world: Any) -> None:
    _model(directory=False)
    resp = staff_client.post(
        "/deployments/preview", {"model": "smol-ui", "n_ctx": "512", "engine": "vllm"}
    )
    assert resp.status_code == 422
    assert "cannot run GGUF" in resp.content.decode()
    bad = staff_client.post("/deployments/preview", {"model": "smol-ui", "engine": "tgi"})
    assert bad.status_code == 422 and "engine must be" in bad.content.decode()
