"""The deployment's engine in the admin API (issue 30): shown in a deployment's JSON, chosen in
POST /api/admin/deployments and the preview, and a 400 naming why vLLM cannot serve the model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from apps.jobs.models import Deployment
from apps.models_repo.models import Model, ModelFile
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


def _model(*formats: str) -> Model:
    m = Model.objects.create(name="smol-engine")
    for i, fmt in enumerate(formats):
        ModelFile.objects.create(
            model=m, file_name=f"f{i}", format=fmt, sha256=f"{i}" * 64, size=1000
        )
    return m


@pytest.mark.parametrize("path", ["/api/admin/deployments", "/api/admin/deployments/preview"])
def test_vllm_for_a_gguf_only_model_is_a_400_naming_why(client: Client, path: str) -> None:
    _model("GGUF")
    NodeFactory(name="has-vllm", hardware={"engines": ["llamacpp", "vllm"]})
    resp = client.post(
        path, {"model": "smol-engine", "engine": "vllm"}, "application/json", headers=OPERATOR
    )
    assert resp.status_code == 400, resp.content
    err = resp.json()["error"]
    assert err["code"] == "engine_unavailable" and err["param"] == "engine"
    assert "only GGUF files" in err["message"] and "cannot run GGUF" in err["message"]
    assert not Deployment.objects.exists()


def test_vllm_without_a_node_that_has_the_engine_is_a_400(client: Client) -> None:
    _model("GGUF", "safetensors")
    NodeFactory(name="llama-only", hardware={"engines": ["llamacpp"]})
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol-engine", "engine": "vllm"},
        "application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 400
    assert "no node has the vLLM engine" in resp.json()["error"]["message"]
    assert not Deployment.objects.exists()
    # With a node that has the engine and a directory, the preview plans one node for vLLM and
    # the deployment is created with its engine and the directory as its file.
    NodeFactory(name="has-vllm", hardware={"engines": ["llamacpp", "vllm"]})
    preview = client.post(
        "/api/admin/deployments/preview",
        {"model": "smol-engine", "engine": "vllm", "n_ctx": 512, "n_parallel": 1},
        "application/json",
        headers=OPERATOR,
    )
    assert preview.status_code == 200, preview.content
    body = preview.json()
    assert body["engine"] == "vllm" and body["primary_name"] == "has-vllm"
    assert body["rpc_endpoints"] == [] and "cannot be split" in body["explanation"][0]
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol-engine", "engine": "vllm", "n_ctx": 512, "n_parallel": 1},
        "application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 202, resp.content
    dep = Deployment.objects.get(pk=resp.json()["id"])
    assert dep.engine == "vllm" and dep.model_file.format == "safetensors"


def test_unknown_engine_is_a_400_and_a_deployment_shows_its_engine(client: Client) -> None:
    m = _model("GGUF")
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol-engine", "engine": "tgi"},
        "application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 400
    assert "engine" in resp.content.decode()
    dep = Deployment.objects.create(model=m, model_file=m.files.get())
    body = client.get(f"/api/admin/deployments/{dep.id}", headers=OPERATOR).json()
    assert body["engine"] == "llamacpp"
    listed = client.get("/api/admin/deployments", headers=OPERATOR).json()
    assert [d["engine"] for d in listed] == ["llamacpp"]


def test_inventory_engines_are_kept_and_checked() -> None:
    from apps.nodes.api import HardwareSerializer

    hw = {
        "cpu": {"model": "x", "physical_cores": 2, "logical_cores": 2},
        "memory": {"total": 2**33, "available": 2**32},
        "swap": {"total": 0, "free": 0},
        "disk": {"path": "/", "total": 1, "free": 1},
        "network": [],
        "gpus": [],
        "engines": ["llamacpp", "vllm"],
    }
    s = HardwareSerializer(data=hw)
    assert s.is_valid(), s.errors
    assert s.validated_data["engines"] == ["llamacpp", "vllm"]
    bad = HardwareSerializer(data={**hw, "engines": ["llamacpp", "tgi"]})
    assert not bad.is_valid() and "engines" in bad.errors


def _model_dir(root: Path) -> Path:
    d = root / "smol-st"
    d.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}
    files = {"config.json": json.dumps(config).encode(), "model.safetensors": b"weights"}
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in sorted(files.items()))
    )
    return d


def test_a_model_directory_registers_as_safetensors_beside_the_gguf(
    client: Client, tmp_path: Path
) -> None:
    m = _model("GGUF")
    d = _model_dir(tmp_path)
    resp = client.post(
        "/api/admin/models",
        {"path": str(d), "name": "smol-engine"},
        "application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 201, resp.content
    listed = client.get("/api/admin/models", headers=OPERATOR).json()
    formats = sorted(f["format"] for x in listed if x["name"] == "smol-engine" for f in x["files"])
    assert formats == ["GGUF", "safetensors"]
    st = m.files.get(format="safetensors")
    assert st.sha256 == hashlib.sha256((d / "SHA256SUMS").read_bytes()).hexdigest()
    assert st.n_layer == 30
    # llama.cpp deployments keep using the GGUF; vLLM now only lacks a node with the engine.
    from apps.jobs.deployments import deployment_create, placement_request_from

    dep = deployment_create(model=m, request=placement_request_from({}), now=timezone.now())
    assert dep.model_file.format == "GGUF"
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol-engine", "engine": "vllm"},
        "application/json",
        headers=OPERATOR,
    )
    assert "no node has the vLLM engine" in resp.json()["error"]["message"]


def test_a_model_directory_whose_file_differs_from_its_manifest_is_refused(
    client: Client, tmp_path: Path
) -> None:
    d = _model_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"tampered")
    resp = client.post("/api/admin/models", {"path": str(d)}, "application/json", headers=OPERATOR)
    assert resp.status_code == 400
    assert "model.safetensors: sha256" in resp.json()["error"]["message"]
    (d / "SHA256SUMS").unlink()
    resp = client.post("/api/admin/models", {"path": str(d)}, "application/json", headers=OPERATOR)
    assert resp.status_code == 400 and "no SHA256SUMS manifest" in resp.json()["error"]["message"]


# --- the scheduler's choice when the operator names no engine ---------------------------------


def _dual_model(*, directory: bool = True) -> Model:
    """SmolLM2's figures: a placeable GGUF (tiny 30-layer profile) and, unless ``directory`` is
    False, its safetensors directory as registered (config.json figures, bfloat16 files)."""
    from apps.models_repo.profile import synthetic_profile
    from tests.factories import ModelFactory, ModelFileFactory

    m = ModelFactory(name="smol-engine")
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
    return m


def _engines_node(name: str, *engines: str) -> None:
    from tests.factories import hardware_profile

    NodeFactory(name=name, hardware={**hardware_profile(), "engines": list(engines)})


def _preview(client: Client, **body: object) -> dict[str, object]:
    resp = client.post(
        "/api/admin/deployments/preview",
        {"model": "smol-engine", "n_ctx": 512, **body},
        "application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 200, resp.content
    out: dict[str, object] = resp.json()
    return out


def test_the_scheduler_picks_vllm_for_several_streams_and_says_why(client: Client) -> None:
    from apps.nodes.models import Event

    _dual_model()
    _engines_node("has-vllm", "llamacpp", "vllm")
    body = _preview(client, n_parallel=8)
    why = str(body["explanation"][0])
    assert body["engine"] == "vllm" and body["n_parallel"] == 8, body
    assert why.startswith("engine vllm (the scheduler's choice)"), why
    assert "8 concurrent streams" in why and "aggregate throughput" in why
    assert "cannot be split over ggml-rpc" in str(body["explanation"][1])
    # Slots left to memory: as many as fit (at least VLLM_AUTO_MIN_PARALLEL here): vLLM too.
    assert _preview(client)["engine"] == "vllm"
    resp = client.post(
        "/api/admin/deployments",
        {"model": "smol-engine", "n_ctx": 512, "n_parallel": 8},
        "application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 202, resp.content
    dep = Deployment.objects.get(pk=resp.json()["id"])
    assert dep.engine == "vllm" and dep.model_file.format == "safetensors"
    assert dep.request["engine"] == "vllm"
    created = Event.objects.get(deployment_id=dep.id, kind="DEPLOYMENT_CREATED")
    assert created.data["engine_reason"].startswith("engine vllm (the scheduler's choice)")


def test_the_scheduler_keeps_llamacpp_and_says_why(client: Client) -> None:
    _dual_model()
    _engines_node("has-vllm", "llamacpp", "vllm")
    # One stream: llama.cpp is faster per stream.
    one = _preview(client, n_parallel=1)
    assert one["engine"] == "llamacpp", one
    assert "faster per stream" in str(one["explanation"][0])
    # The operator's explicit choice wins, both ways, with no scheduler's reason.
    explicit = _preview(client, n_parallel=8, engine="llamacpp")
    assert explicit["engine"] == "llamacpp"
    assert not any("scheduler's choice" in str(x) for x in explicit["explanation"])  # type: ignore[attr-defined]
    assert _preview(client, n_parallel=1, engine="vllm")["engine"] == "vllm"


def test_without_a_vllm_node_or_a_directory_the_scheduler_says_why_not(client: Client) -> None:
    m = _dual_model()
    _engines_node("llama-only", "llamacpp")
    body = _preview(client, n_parallel=8)
    assert body["engine"] == "llamacpp"
    why = str(body["explanation"][0])
    assert why.startswith("engine llamacpp (the scheduler's choice): not vLLM"), why
    assert "no eligible node has the vLLM engine" in why
    m.files.filter(format="safetensors").delete()
    _engines_node("has-vllm", "llamacpp", "vllm")
    body = _preview(client, n_parallel=8)
    assert body["engine"] == "llamacpp"
    assert "no safetensors directory" in str(body["explanation"][0])
