"""Fixtures shared by the tests in tests/jobs: SmolLM2's profile and a model with a store copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from apps.models_repo.models import Model
from apps.models_repo.profile import read_gguf_profile
from tests.factories import ModelFactory, ModelFileFactory
from tests.smollm2 import smollm2_path


@pytest.fixture(scope="module")
def profile_dict() -> dict[str, Any]:
    return read_gguf_profile(smollm2_path()).to_dict()


@pytest.fixture
def model(profile_dict: dict[str, Any], tmp_path: Path) -> Model:
    m = ModelFactory(name="smol")
    # The controller's store copy that replica claims are challenged against (random stand-in bytes).
    store = tmp_path / "store-smol.gguf"
    store.write_bytes(os.urandom(3 * 2**20))
    ModelFileFactory(
        model=m,
        file_name="smol.gguf",
        sha256="b" * 64,
        size=98_000_000,
        n_layer=30,
        profile=profile_dict,
        store_path=str(store),
    )
    return m
