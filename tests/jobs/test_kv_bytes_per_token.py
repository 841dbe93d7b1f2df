"""The deployments page's KV memory figure (apps/jobs/kvcache.kv_bytes_per_token) reads the model
file's stored profile as ModelProfile.to_dict() writes it: the per-layer figure is a derived one
(under "derived"), the layer count a stored one. It read the per-layer figure at the top level and
so answered 0 for every registered model (issue 28 round two)."""

from __future__ import annotations

import pytest

from apps.jobs import kvcache
from apps.models_repo.models import Model, ModelFile
from apps.models_repo.profile import synthetic_profile

pytestmark = pytest.mark.django_db


def test_a_registered_models_kv_bytes_per_token_is_its_layers_times_the_per_layer_figure() -> None:
    profile = synthetic_profile(
        name="tiny", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152
    )
    model_file = ModelFile.objects.create(
        model=Model.objects.create(name="kv-bytes"),
        file_name="m.gguf",
        sha256="ab" * 32,
        size=1024,
        n_layer=30,
        profile=profile.to_dict(),
    )
    model_file.refresh_from_db()  # the profile as the database returns it (JSON)
    expected = profile.kv_bytes_per_token_per_layer * 30
    assert expected > 0
    assert kvcache.kv_bytes_per_token(model_file) == expected


def test_a_file_without_a_profile_has_no_kv_figure() -> None:
    assert kvcache.kv_bytes_per_token(None) == 0
    model_file = ModelFile(file_name="m.gguf", sha256="cd" * 32, size=1, n_layer=0, profile={})
    assert kvcache.kv_bytes_per_token(model_file) == 0
