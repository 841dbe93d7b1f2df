"""Setup shared by the tests in tests/jobs: chat payloads and READY deployments for the KV cache
tests (test_kvcache.py, test_kvtransfer.py), and a model with a store copy and a placeable
profile for the tests that place or fail over through FakeAgents (test_failover_slots.py,
test_serving_wait.py), nodes holding a replica and a READY deployment over one node (placement,
drain and replica tests)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from apps.models_repo.profile import synthetic_profile
from apps.nodes.states import NodeState
from tests.factories import (
    DeploymentFactory,
    ModelFactory,
    ModelFileFactory,
    NodeFactory,
    ReplicaFactory,
)

GiB = 1024**3
SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*turns: str) -> dict[str, Any]:
    """A chat payload: the system message, then the turns (user first, alternating)."""
    msgs: list[dict[str, Any]] = [SYSTEM]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"messages": msgs}


def kv_model(*, name: str, sha256: str) -> Model:
    """A model with one 1000-byte file (no store copy: nothing places it)."""
    return ModelFileFactory(
        model__name=name, file_name="m.gguf", sha256=sha256, size=1000, n_layer=0
    ).model


def deployment(model: Model, *, n_parallel: int = 2) -> Deployment:
    """A READY deployment of ``model`` on a new node, with ``n_parallel`` slots."""
    return DeploymentFactory(
        model=model, model_file=model.files.get(), n_parallel=n_parallel, n_ctx=2048
    )


def placeable_model(*, name: str, sha256: str, store: Path, store_bytes: int) -> Model:
    """A model whose file has a tiny 30-layer profile (the scheduler can place it) and a store
    copy of ``store_bytes`` random bytes at ``store`` (a node's replica claim is challenged
    against it)."""
    m = ModelFactory(name=name)
    store.write_bytes(os.urandom(store_bytes))
    tiny = synthetic_profile(
        name="tiny", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152
    )
    ModelFileFactory(
        model=m,
        file_name="m.gguf",
        sha256=sha256,
        size=100 * 1024**2,
        n_layer=30,
        profile=tiny.to_dict(),
        store_path=str(store),
    )
    return m


def nodes_with_replicas(model: Model, n: int) -> list[Any]:
    out = []
    for i in range(n):
        node = NodeFactory(
            name=f"n{i}", state=NodeState.READY, ram_available=8 * GiB, gflops=50 + i
        )
        ReplicaFactory(node=node, model_file=model.files.get(), path=f"/models/{i}.gguf")
        out.append(node)
    return out


def ready_deployment(model: Model, node: Any) -> Deployment:
    dep = DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        primary=node,
        request={"n_ctx": 512},
        plan={
            "primary_node_id": str(node.id),
            "devices": [
                {
                    "node_id": str(node.id),
                    "device": "CPU",
                    "layer_start": 0,
                    "layer_end": 30,
                    "memory_bytes": GiB,
                    "endpoint": None,
                }
            ],
        },
    )
    dep.nodes.set([node])
    return dep


def planning_deployment(model: Model) -> Deployment:
    """A deployment of ``model`` as the API makes it: PLANNING, no primary, n_ctx 512."""
    return DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        state=DeploymentState.PLANNING,
        primary=None,
        request={"n_ctx": 512},
    )
