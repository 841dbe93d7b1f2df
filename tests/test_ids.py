"""racon/ids.py: an id is converted once, to its canonical text, and junk is refused by name."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from racon import ids


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Pure: no services needed (overrides the suite's Redis-cleaning fixture)."""


def test_a_uuid_and_its_text_give_the_same_id() -> None:
    u = uuid.uuid4()
    assert ids.node_id(u) == ids.node_id(str(u)) == ids.node_id(str(u).upper()) == str(u)
    assert ids.job_id(u.hex) == str(u)  # the 32-digit form too


@pytest.mark.parametrize(
    "convert, what",
    [(ids.node_id, "node"), (ids.job_id, "job"), (ids.deployment_id, "deployment"),
     (ids.account_id, "account"), (ids.model_id, "model"), (ids.api_key_id, "API key")],
)  # fmt: skip
def test_anything_else_is_refused_naming_the_kind_of_id(
    convert: Callable[[str], str], what: str
) -> None:
    with pytest.raises(ValueError, match=f"not a {what} id: 'node-1'"):
        convert("node-1")
