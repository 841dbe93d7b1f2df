"""A vLLM primary's KV events as the router reads them (issue 30): the node's key may lower the
controller's prefix record (evicted blocks), never raise it; no key leaves the record as it is."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from agent.protocol import kv_held_key
from apps.jobs.kvcache import Owner, engine_claim_lowered
from racon.ids import DeploymentId
from racon.redis import get_redis

VLLM = SimpleNamespace(id="dep-v", engine="vllm", primary_id="node-v")
LLAMA = SimpleNamespace(id="dep-l", engine="llamacpp", primary_id="node-l")


@pytest.fixture
def key() -> Iterator[str]:
    k = kv_held_key("node-v", "dep-v")
    yield k
    get_redis().delete(k)


def owner(dep: str, tokens: int = 64) -> Owner:
    return Owner(deployment_id=DeploymentId(dep), slot=1, tokens=tokens, prefix="p", depth=1)


def test_events_lower_never_raise(key: str) -> None:
    r = get_redis()
    same, note = engine_claim_lowered(owner("dep-v"), [VLLM, LLAMA])
    assert same == owner("dep-v") and note == ""  # no report: the record stands
    r.set(key, json.dumps({"1": 500}))
    same, note = engine_claim_lowered(owner("dep-v"), [VLLM, LLAMA])
    assert same is not None and same.tokens == 64 and "confirm" in note  # never raised
    r.set(key, json.dumps({"1": 32}))
    lower, note = engine_claim_lowered(owner("dep-v"), [VLLM, LLAMA])
    assert lower is not None and lower.tokens == 32 and "lowered to 32" in note
    r.set(key, json.dumps({"1": 0, "0": 999}))
    gone, note = engine_claim_lowered(owner("dep-v"), [VLLM, LLAMA])
    assert gone is None and "no longer holds" in note
    # A llama.cpp owner is never read from a node's key.
    kept, _ = engine_claim_lowered(owner("dep-l"), [VLLM, LLAMA])
    assert kept == owner("dep-l")
