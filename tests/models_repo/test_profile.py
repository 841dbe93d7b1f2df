"""Model profiles read from GGUF files: the real SmolLM2 file and small files written here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from apps.models_repo.profile import ModelFileError, ModelProfile, read_gguf_profile, sha256_file

REPO = Path(__file__).resolve().parents[2]


def _smollm2() -> Path:
    """The real model: checkout, user cache, else downloaded once (tests/smollm2.py)."""
    from tests.smollm2 import NAME, smollm2_path

    try:
        return smollm2_path()
    except Exception:  # no registry reachable: the real-model tests skip, saying why
        return Path(__file__).resolve().parents[2] / "var" / "models" / NAME


SMOLLM2 = _smollm2()


@pytest.fixture(autouse=True)
def _clean_redis() -> Iterator[None]:
    """These tests are pure: override the suite's Redis-cleaning fixture so they need no services."""
    yield


@pytest.fixture(scope="module")
def smollm2() -> ModelProfile:
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is not there and could not be downloaded")
    return read_gguf_profile(SMOLLM2)


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 100,
    tied: bool = False,
    quant: GGMLQuantizationType = GGMLQuantizationType.F32,
    file_type: int | None = None,
    n_expert: int = 0,
    n_expert_used: int = 0,
    context_length: int = 1024,
) -> Path:
    """Write a tiny llama-shaped GGUF with real tensors of the given shape."""
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{n_layer}")
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_feed_forward_length(n_ff)
    w.add_context_length(context_length)
    w.add_vocab_size(n_vocab)
    if file_type is not None:
        w.add_file_type(file_type)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    rng = np.random.default_rng(0)
    head_dim = n_embd // n_head

    def add(name: str, *shape: int) -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if quant == GGMLQuantizationType.F32 or len(shape) == 1:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, quant), raw_dtype=quant)

    add("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        add(f"blk.{i}.attn_norm.weight", n_embd)
        add(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        add(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        add(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        add(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        add(f"blk.{i}.ffn_norm.weight", n_embd)
        if n_expert:
            add(f"blk.{i}.ffn_gate_inp.weight", n_expert, n_embd)
            add(f"blk.{i}.ffn_gate_exps.weight", n_expert, n_ff, n_embd)
            add(f"blk.{i}.ffn_up_exps.weight", n_expert, n_ff, n_embd)
            add(f"blk.{i}.ffn_down_exps.weight", n_expert, n_embd, n_ff)
        else:
            add(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
            add(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
            add(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    add("output_norm.weight", n_embd)
    if not tied:
        add("output.weight", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- the real model ---------------------------------------------------------------------------


def test_real_smollm2_profile_has_the_published_shape(smollm2: ModelProfile) -> None:
    p = smollm2
    assert (p.architecture, p.n_layer, p.n_embd, p.n_head, p.n_head_kv) == ("llama", 30, 576, 9, 3)
    assert p.n_ctx_train == 8192
    assert p.n_vocab == 49152
    assert p.quantization == "Q4_1"
    assert p.head_dim == 64
    # 2 (K and V) x 3 KV heads x 64 x 2 bytes (f16)
    assert p.kv_bytes_per_token_per_layer == 2 * 3 * 64 * 2
    assert p.activation_bytes == 576 * 4


def test_real_smollm2_bytes_add_up_to_the_file(smollm2: ModelProfile) -> None:
    p = smollm2
    assert len(p.layer_bytes) == 30 and len(set(p.layer_bytes)) == 1  # a uniform Q4_1 stack
    # No output.weight: llama.cpp duplicates token_embd onto the output device.
    assert p.tied_embeddings
    stored = (
        sum(p.layer_bytes)
        + p.embedding_bytes
        + (p.output_bytes - p.embedding_bytes)
        + p.other_bytes
    )
    assert stored == p.tensor_bytes
    assert p.tensor_bytes < p.file_size < p.tensor_bytes + 4 * 2**20  # metadata and tokenizer
    # ~135M parameters, counting the LM head (tied to the embeddings) once.
    assert 125e6 < p.params < 140e6
    assert p.flops_per_token == 2 * p.params


def test_profile_round_trips_through_json(smollm2: ModelProfile) -> None:
    data = json.loads(json.dumps(smollm2.to_dict()))
    assert data["derived"]["kv_bytes_per_token_per_layer"] == 768
    assert ModelProfile.from_dict(data) == smollm2


# --- written files in several shapes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab", "tied"),
    [
        (1, 32, 2, 2, 64, 50, False),  # one block, plain multi-head attention
        (3, 64, 4, 1, 96, 120, True),  # multi-query attention, tied embeddings
        (6, 128, 8, 4, 256, 64, False),  # grouped-query attention
    ],
)
def test_written_gguf_shapes_are_read_back(
    tmp_path: Path,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    tied: bool,
) -> None:
    path = write_gguf(
        tmp_path / "m.gguf",
        tied=tied,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
    )
    p = read_gguf_profile(path)
    head_dim = n_embd // n_head
    assert (p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.n_ff, p.n_vocab) == (
        n_layer,
        n_embd,
        n_head,
        n_head_kv,
        n_ff,
        n_vocab,
    )
    per_layer_params = (
        2 * n_embd * n_embd + 2 * n_head_kv * head_dim * n_embd + 3 * n_embd * n_ff + 2 * n_embd
    )
    assert p.layer_params == (per_layer_params,) * n_layer
    assert p.layer_bytes == (4 * per_layer_params,) * n_layer  # F32
    assert p.embedding_bytes == 4 * n_vocab * n_embd
    head = n_vocab * n_embd  # output.weight, or the duplicated token_embd when tied
    assert p.output_bytes == 4 * (head + n_embd)
    assert p.tied_embeddings is tied
    assert p.kv_bytes_per_token_per_layer == 2 * n_head_kv * head_dim * 2
    assert p.quantization == "F32"  # no general.file_type: named after the block weights


def test_quantized_layers_count_their_stored_bytes(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "q8.gguf",
        quant=GGMLQuantizationType.Q8_0,
        file_type=int(LlamaFileType.MOSTLY_Q8_0),
        n_layer=2,
        n_embd=64,
        n_ff=128,
    )
    p = read_gguf_profile(path)
    assert p.quantization == "Q8_0"
    f32 = read_gguf_profile(write_gguf(tmp_path / "f32.gguf", n_layer=2, n_embd=64, n_ff=128))
    # Q8_0 stores 34 bytes per 32 weights; norms stay f32.
    assert p.layer_params == f32.layer_params
    assert p.layer_bytes[0] < f32.layer_bytes[0] * 0.3


def test_mixture_of_experts_flops_count_only_the_active_experts(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "moe.gguf", n_layer=2, n_embd=32, n_ff=64, n_expert=4, n_expert_used=1
    )
    p = read_gguf_profile(path)
    assert (p.n_expert, p.n_expert_used) == (4, 1)
    experts = 3 * 4 * 32 * 64
    # The bytes hold every expert; a token only runs one of four.
    assert p.layer_bytes[0] > 4 * experts
    assert p.layer_params[0] < experts // 2


def test_skimming_reader_gives_the_same_profile_as_the_package_reader(tmp_path: Path) -> None:
    from gguf import GGUFReader

    from apps.models_repo.profile import _profile_from_reader

    path = tmp_path / "tok.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_name("with-tokenizer")
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv([1, 2, 4])  # per-layer KV heads: the worst case counts
    w.add_feed_forward_length(128)
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_token_types([1] * 300)
    w.add_token_merges([f"t o{i}" for i in range(200)])
    rng = np.random.default_rng(2)
    w.add_tensor("token_embd.weight", rng.standard_normal((300, 64)).astype(np.float32))
    for i in range(3):
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    skimmed = read_gguf_profile(path)
    plain = _profile_from_reader(GGUFReader(path, "r"), path.name, path.stat().st_size)
    assert skimmed == plain
    assert (skimmed.n_vocab, skimmed.n_head_kv, skimmed.name) == (300, 4, "with-tokenizer")


@pytest.mark.parametrize(
    "content",
    [b"", b"not a gguf at all, just text", b"GGUF" + b"\xff" * 64],
    ids=["empty", "text", "bad-header"],
)
def test_corrupt_file_is_refused_with_the_parser_message(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as err:
        read_gguf_profile(path)
    assert str(err.value).startswith("bad.gguf: ")
    assert len(str(err.value)) > len("bad.gguf: ")


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf", n_layer=2)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelFileError):
        read_gguf_profile(cut)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="No such file"):
        read_gguf_profile(tmp_path / "nope.gguf")


def test_gguf_without_block_count_is_refused(tmp_path: Path) -> None:
    w = GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="llama.block_count is missing"):
        read_gguf_profile(tmp_path / "meta.gguf")


def test_shard_of_a_split_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m-00001-of-00002.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_uint16("split.count", 2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="2-file split GGUF"):
        read_gguf_profile(path)


# --- hashing ----------------------------------------------------------------------------------


def test_sha256_file_matches_hashlib_and_reports_progress(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(1).bytes(3 * 1024 * 1024 + 17)
    path.write_bytes(data)
    seen: list[tuple[int, int]] = []
    digest = sha256_file(
        path, progress=lambda done, total: seen.append((done, total)), chunk_size=1 << 20
    )
    assert digest == hashlib.sha256(data).hexdigest()
    assert [d for d, _ in seen] == [1 << 20, 2 << 20, 3 << 20, len(data)]
    assert {t for _, t in seen} == {len(data)}
