"""make run with RACON_ENGINES naming vllm (issue 30): racon_bootstrap --model-dir registers the
converted directory as the default model's second format, once."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from django.core.management import call_command

from apps.models_repo.models import Model, ModelFile

pytestmark = pytest.mark.django_db


def test_bootstrap_adds_the_model_directory_as_the_default_models_second_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RACON_ADMIN_PASSWORD", "a-long-enough-test-password")
    m = Model.objects.create(name="smollm2")
    ModelFile.objects.create(model=m, file_name="s.gguf", sha256="1" * 64, size=10)
    d = tmp_path / "smollm2-135m-safetensors"
    d.mkdir()
    files = {
        "config.json": b'{"model_type": "llama", "num_hidden_layers": 30}',
        "model.safetensors": b"w",
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in sorted(files.items()))
    )
    for _ in range(2):  # a second make run finds it registered
        out = io.StringIO()
        call_command("racon_bootstrap", "--model-dir", str(d), stdout=out)
        assert json.loads(out.getvalue().splitlines()[-1])["model"] == "smollm2"
    assert sorted(m.files.values_list("format", flat=True)) == ["GGUF", "safetensors"]
