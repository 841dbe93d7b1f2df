from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _clean_redis(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each controller test starts with an empty (test-only) Redis database."""
    if "tests/agent" in str(request.node.path):
        yield  # agent tests manage their own keys and must not need Django
        return
    from racon import cache
    from racon.redis import get_redis

    r = get_redis()
    r.flushdb()
    # The in-process caches (principal, model, route) outlive a test's rolled-back rows.
    cache.clear_local(cache.ALL)
    yield
    r.flushdb()


@pytest.fixture
def now() -> Any:
    from django.utils import timezone

    return timezone.now()
