"""vLLM plans in the pure scheduler (issue 30): one node with the engine, its memory the weights
plus the KV cache it is given plus the runtime; a model that fits no single node is refused,
naming llama.cpp, which can split it over the same nodes."""

from __future__ import annotations

import pytest

from apps.jobs.scheduler import (
    ClusterSnapshot,
    DeviceSnapshot,
    NodeSnapshot,
    PlacementRefused,
    PlacementRequest,
    VllmModel,
    plan_placement,
    plan_vllm,
)
from apps.jobs.scheduler.vllm import VLLM_RUNTIME_BYTES
from apps.models_repo.profile import synthetic_profile
from racon.ids import NodeId

GiB = 1 << 30
# SmolLM2-135M's directory as registered (config.json figures, bfloat16 files).
SMOL = VllmModel.from_config(
    size=270_000_000, dtype="bfloat16", n_layer=30, n_embd=576, n_head=9, n_head_kv=3
)


def node(
    nid: str, gib: float, *, engines: tuple[str, ...] = ("llamacpp", "vllm"), bw: float = 20.0
) -> NodeSnapshot:
    return NodeSnapshot(
        node_id=NodeId(nid),
        name=f"host-{nid}",
        state="READY",
        address=f"10.0.0.{len(nid)}",
        rpc_port=50052,
        devices=(DeviceSnapshot(NodeId(nid), "CPU", "cpu", int(gib * GiB), 100.0, bw),),
        threads=2,
        engines=engines,
    )


def test_one_node_with_the_engine_weights_plus_kv() -> None:
    cluster = ClusterSnapshot(
        nodes=(node("a", 16, engines=("llamacpp",)), node("b", 8, bw=10), node("c", 8, bw=30))
    )
    plan = plan_vllm(SMOL, cluster, PlacementRequest(n_ctx=1024, n_parallel=2, engine="vllm"))
    assert plan.engine == "vllm" and plan.primary_node_id == "c"  # the faster node with vLLM
    assert plan.rpc_endpoints == () and plan.tensor_split == () and len(plan.devices) == 1
    # float32 weights (twice the bf16 files) + KV for 2 x 1024 tokens, whole GiB, + the runtime
    assert SMOL.weights_bytes == 540_000_000
    assert SMOL.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert plan.kv_bytes == GiB
    assert plan.devices[0].memory_bytes == 540_000_000 + GiB + VLLM_RUNTIME_BYTES
    body = plan.to_dict()
    assert body["engine"] == "vllm" and body["kv_bytes"] == GiB
    assert "cannot be split over ggml-rpc" in body["explanation"][0]
    assert "weights" in body["explanation"][1] and "KV given" in body["explanation"][1]


def test_slots_left_to_memory_shrink_to_what_fits() -> None:
    # 3.5 GiB: weights 0.5 + runtime 1.5 leave 1.5 GiB; 16 x 2048 tokens need 2 GiB of KV.
    cluster = ClusterSnapshot(nodes=(node("a", 3.5),))
    plan = plan_vllm(SMOL, cluster, PlacementRequest(n_ctx=2048, n_parallel=None, engine="vllm"))
    assert plan.n_parallel < 16 and plan.kv_bytes == GiB


def test_a_model_no_single_node_holds_stays_on_llamacpp() -> None:
    big = VllmModel.from_config(
        size=16 * GiB, dtype="bfloat16", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8
    )
    nodes = (node("a", 3), node("b", 3))  # 32 GiB in float32 for vLLM; 4.2 GiB at Q4_K_M
    with pytest.raises(PlacementRefused) as info:
        plan_vllm(big, ClusterSnapshot(nodes=nodes), PlacementRequest(n_ctx=2048, engine="vllm"))
    assert "no single node with the vLLM engine" in info.value.reason
    assert "engine llamacpp" in info.value.reason and info.value.missing_bytes > 0
    # llama.cpp splits the same model (its GGUF) over the same two nodes.
    profile = synthetic_profile(
        name="llama-8b", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336,
        n_vocab=128256,
    )  # fmt: skip
    split = plan_placement(profile, ClusterSnapshot(nodes=nodes), PlacementRequest(n_ctx=2048))
    assert split.engine == "llamacpp" and len(split.node_ids) == 2


def test_no_node_with_the_engine_is_refused_naming_the_install() -> None:
    cluster = ClusterSnapshot(nodes=(node("a", 16, engines=("llamacpp",)),))
    with pytest.raises(PlacementRefused, match="install-vllm.sh"):
        plan_vllm(SMOL, cluster, PlacementRequest(engine="vllm"))


def test_the_scheduler_chooses_an_engine_and_says_why() -> None:
    from apps.jobs.scheduler import choose_engine

    cluster = ClusterSnapshot(nodes=(node("a", 16),))
    many = plan_vllm(SMOL, cluster, PlacementRequest(n_ctx=1024, n_parallel=8, engine="vllm"))
    one = plan_vllm(SMOL, cluster, PlacementRequest(n_ctx=1024, n_parallel=1, engine="vllm"))
    profile = synthetic_profile(
        name="tiny", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152
    )
    llama = plan_placement(profile, cluster, PlacementRequest(n_ctx=1024, n_parallel=8))
    engine, why = choose_engine(vllm=many, llamacpp=llama, min_parallel=4)
    assert engine == "vllm" and "8 concurrent streams" in why
    engine, why = choose_engine(vllm=one, llamacpp=llama, min_parallel=4)
    assert engine == "llamacpp" and "faster per stream" in why
    # Few streams, but llama.cpp cannot place it (or the model has no GGUF): vLLM after all.
    refused = PlacementRefused("no node holds 40 GiB")
    engine, why = choose_engine(vllm=one, llamacpp=refused, min_parallel=4)
    assert engine == "vllm" and "no node holds 40 GiB" in why
    assert choose_engine(vllm=one, llamacpp=None)[0] == "vllm"
    # No directory, or vLLM refused: llama.cpp, naming why.
    engine, why = choose_engine(vllm=None, llamacpp=llama)
    assert engine == "llamacpp" and "no safetensors directory" in why
    engine, why = choose_engine(vllm=PlacementRefused("no single node"), llamacpp=llama)
    assert engine == "llamacpp" and "not vLLM, no single node" in why
    # Nothing but a directory vLLM cannot place: vLLM's refusal is the answer.
    assert choose_engine(vllm=PlacementRefused("no single node"), llamacpp=None)[0] == "vllm"
