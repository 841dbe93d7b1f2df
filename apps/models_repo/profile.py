"""Model profile: what the scheduler needs to know about a GGUF file, read from the file itself.

Pure module (no Django): the controller stores ``ModelProfile.to_dict()`` as JSON on the
``ModelFile`` row and hands ``ModelProfile.from_dict(...)`` to ``apps.jobs.scheduler``.

How the numbers map onto llama.cpp (checked against the vendored llama.cpp source):
- ``token_embd`` always stays on the primary's CPU (llama.cpp never offloads the input layer).
- ``output`` / ``output_norm`` go to the device of the last offloaded layer. When the file has
  no ``output.weight`` (tied embeddings, e.g. SmolLM2) llama.cpp loads a *second copy* of
  ``token_embd`` there, so ``output_bytes`` counts that copy: it is what the output device holds.
- The KV cache of a layer lives on that layer's device, f16 by default.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType

# llama.cpp's KV cache type is f16 unless the operator asks for a quantised cache.
KV_BYTES_PER_ELEMENT = 2
# Activations travel between devices as f32 (ggml's default for the residual stream).
ACTIVATION_BYTES_PER_ELEMENT = 4
SHA256_CHUNK_BYTES = 1 << 20

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


class ModelFileError(Exception):
    """The file is not a usable GGUF model; the message is the parser's own."""


@dataclass(frozen=True)
class ModelProfile:
    """Shape and size of one GGUF model file, as the scheduler's cost model sees it."""

    architecture: str
    name: str
    quantization: str  # "Q4_1", "Q4_K_M", "F16"...; from general.file_type, else guessed
    file_type: int | None
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    n_vocab: int
    key_length: int  # per-head K width (attention.key_length, else n_embd / n_head)
    value_length: int
    layer_bytes: tuple[int, ...]  # weight bytes of blk.N.*, index N
    layer_params: tuple[int, ...]  # elements touched per token by blk.N.* (active experts only)
    embedding_bytes: int  # token_embd.*; always on the primary's CPU
    output_bytes: int  # output.* + output_norm.*, plus the token_embd copy when tied
    output_params: int
    other_bytes: int  # tensors outside blocks/embeddings/output (rope factors...), on the primary
    tensor_bytes: int  # sum of all tensors as stored in the file
    file_size: int
    tied_embeddings: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff: int = 0  # feed_forward_length; sizes llama.cpp's compute buffer

    # --- derived -----------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.key_length

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        # K and V rows for every KV head, f16.
        return self.n_head_kv * (self.key_length + self.value_length) * KV_BYTES_PER_ELEMENT

    @property
    def activation_bytes(self) -> int:
        """Bytes of the hidden state that crosses a device boundary, per token."""
        return self.n_embd * ACTIVATION_BYTES_PER_ELEMENT

    @property
    def logits_bytes(self) -> int:
        """Bytes of one token's logits, read back by the primary from the output device."""
        return self.n_vocab * 4

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.output_params

    @property
    def flops_per_token(self) -> int:
        # A matmul costs 2 FLOPs per weight element; the embedding lookup is a copy.
        return 2 * self.params

    @property
    def layer_flops(self) -> tuple[int, ...]:
        return tuple(2 * p for p in self.layer_params)

    @property
    def max_layer_bytes(self) -> int:
        return max(self.layer_bytes) if self.layer_bytes else 0

    @property
    def mean_layer_bytes(self) -> float:
        return sum(self.layer_bytes) / self.n_layer if self.n_layer else 0.0

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights as llama.cpp holds them (tied output copy included)."""
        return sum(self.layer_bytes) + self.embedding_bytes + self.output_bytes + self.other_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: stored fields plus derived figures (ignored by from_dict)."""
        d = asdict(self)
        d["layer_bytes"] = list(self.layer_bytes)
        d["layer_params"] = list(self.layer_params)
        d["derived"] = {
            "head_dim": self.head_dim,
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token_per_layer,
            "activation_bytes": self.activation_bytes,
            "flops_per_token": self.flops_per_token,
            "params": self.params,
            "weight_bytes": self.weight_bytes,
        }
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Inverse of to_dict; unknown keys (derived figures, later additions) are ignored."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["layer_bytes"] = tuple(int(x) for x in kwargs.get("layer_bytes", ()))
        kwargs["layer_params"] = tuple(int(x) for x in kwargs.get("layer_params", ()))
        return cls(**kwargs)


def _array_values(reader: Any, field: Any) -> tuple[int, list[Any]]:
    """(element count, numeric values) of an array field from either reader."""
    if getattr(reader, "skims_arrays", False):
        part = field.parts[field.data[0]]
        if field.types[1] == GGUFValueType.STRING:
            return int(part[0]), []  # the part is the element count
        return len(part), part.tolist()
    values = list(field.contents())
    return len(field.data), [v for v in values if isinstance(v, int | float)]


def _field_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        # Per-layer arrays (e.g. head_count_kv in OpenELM): the scheduler wants the worst case.
        _, numbers = _array_values(reader, field)
        return max(numbers) if numbers else None
    return field.contents()


def _quantization_name(file_type: int | None, tensors: list[Any]) -> str:
    if file_type is not None:
        try:
            name = LlamaFileType(file_type).name
        except ValueError:
            name = ""
        if name and name != "GUESSED":
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    # Old or hand-made files lack general.file_type: name the type holding most block weight.
    by_type: dict[str, int] = {}
    for t in tensors:
        if _BLOCK_RE.match(t.name) and len(t.shape) >= 2:
            key = GGMLQuantizationType(t.tensor_type).name
            by_type[key] = by_type.get(key, 0) + int(t.n_bytes)
    return max(by_type, key=lambda k: by_type[k]) if by_type else "unknown"


def _skimming_reader(path: str | os.PathLike[str]) -> Any:
    """A GGUFReader that does not build a numpy view per array element.

    GGUFReader makes one view per element of every array; SmolLM2's tokenizer (49k tokens,
    49k token types, 49k merges) then costs ~5 s of CPU, and a 128k-vocab tokenizer several
    times that. The profile never reads the strings, so for native-endian files a string array
    is only walked to find where the next field starts (parts: item type, count), and a numeric
    array becomes one view (parts: item type, count, values). Everything else, the errors
    included, is the gguf package's.
    """

    class _SkimmingReader(GGUFReader):
        skims_arrays = True

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            native = self.byte_order == "I" and sys.byteorder == "little"
            if raw_type != GGUFValueType.ARRAY or not native:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype = GGUFValueType(int(raw_itype[0]))
            types = [GGUFValueType.ARRAY, itype]
            offs = orig_offs + 12
            if itype == GGUFValueType.STRING:
                view = memoryview(self.data)
                for _ in range(int(alen[0])):
                    (slen,) = struct.unpack_from("<Q", view, offs)
                    offs += 8 + slen
                if offs > len(self.data):
                    raise ValueError(f"string array at offset {orig_offs} runs past the end")
                return offs - orig_offs, [raw_itype, alen], [1], types
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:  # nested arrays: leave them to the package
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, int(alen[0]))
            if len(values) != int(alen[0]):
                raise ValueError(f"array at offset {orig_offs} runs past the end")
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types

    return _SkimmingReader(path, "r")


def read_gguf_profile(path: str | os.PathLike[str]) -> ModelProfile:
    """Read a GGUF file's metadata and tensor sizes; ModelFileError when it is not a usable GGUF."""
    try:
        file_size = os.path.getsize(path)
        reader = _skimming_reader(path)
    except ModelFileError:
        raise
    except Exception as exc:  # the parser's message is the useful part for the operator
        raise ModelFileError(f"{Path(path).name}: {exc}") from exc
    try:
        return _profile_from_reader(reader, Path(path).name, file_size)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{Path(path).name}: {exc}") from exc


def _profile_from_reader(reader: Any, file_name: str, file_size: int) -> ModelProfile:
    arch = _field_value(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{file_name}: general.architecture is missing")
    shards = _field_value(reader, "split.count")
    if shards is not None and int(shards) > 1:
        # The other shards hold most tensors; a profile of one shard would undercount them.
        raise ModelFileError(
            f"{file_name}: shard of a {int(shards)}-file split GGUF; merge it with gguf-split first"
        )

    def meta_int(key: str, default: int | None = None) -> int:
        value = _field_value(reader, f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ModelFileError(f"{file_name}: {arch}.{key} is missing")
            return default
        return int(value)

    n_layer = meta_int("block_count")
    n_embd = meta_int("embedding_length")
    n_head = meta_int("attention.head_count")
    n_head_kv = meta_int("attention.head_count_kv", n_head)
    if n_layer <= 0 or n_embd <= 0 or n_head <= 0:
        raise ModelFileError(
            f"{file_name}: implausible shape n_layer={n_layer} n_embd={n_embd} n_head={n_head}"
        )
    key_length = meta_int("attention.key_length", n_embd // n_head)
    value_length = meta_int("attention.value_length", key_length)
    n_ctx_train = meta_int("context_length", 0)
    n_expert = meta_int("expert_count", 0)
    n_expert_used = meta_int("expert_used_count", 0)
    n_ff = meta_int("feed_forward_length", 4 * n_embd)

    layer_bytes = [0] * n_layer
    layer_params = [0] * n_layer
    embedding_bytes = output_bytes = output_params = other_bytes = tensor_bytes = 0
    has_output_weight = False
    embd_params = 0
    embd_vocab = 0
    for t in reader.tensors:
        n_bytes = int(t.n_bytes)
        n_elements = int(t.n_elements)
        if int(t.data_offset) + n_bytes > file_size:
            raise ModelFileError(f"{file_name}: tensor {t.name} runs past the end of the file")
        tensor_bytes += n_bytes
        m = _BLOCK_RE.match(t.name)
        if m:
            i = int(m.group(1))
            if i >= n_layer:
                raise ModelFileError(f"{file_name}: tensor {t.name} beyond block_count {n_layer}")
            layer_bytes[i] += n_bytes
            # Mixture-of-experts: a token only runs n_expert_used of the n_expert expert slices.
            if "_exps" in t.name and n_expert > 0 and n_expert_used > 0:
                layer_params[i] += n_elements * n_expert_used // n_expert
            else:
                layer_params[i] += n_elements
        elif t.name.startswith("token_embd."):
            embedding_bytes += n_bytes
            if t.name == "token_embd.weight":
                embd_params = n_elements
                embd_vocab = int(t.shape[-1]) if len(t.shape) > 1 else 0
        elif t.name.startswith("output.") or t.name.startswith("output_norm."):
            output_bytes += n_bytes
            output_params += n_elements
            has_output_weight = has_output_weight or t.name == "output.weight"
        else:
            other_bytes += n_bytes
    if not reader.tensors:
        raise ModelFileError(f"{file_name}: no tensors")

    tied = not has_output_weight
    if tied:
        # llama.cpp duplicates token_embd onto the output device (TENSOR_DUPLICATED).
        output_bytes += embedding_bytes
        output_params += embd_params

    n_vocab = meta_int("vocab_size", 0)
    if not n_vocab:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        n_vocab = _array_values(reader, tokens)[0] if tokens is not None else embd_vocab

    file_type = _field_value(reader, "general.file_type")
    name = _field_value(reader, "general.name")
    return ModelProfile(
        architecture=arch,
        name=str(name) if name else Path(file_name).stem,
        quantization=_quantization_name(
            int(file_type) if file_type is not None else None, list(reader.tensors)
        ),
        file_type=int(file_type) if file_type is not None else None,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        key_length=key_length,
        value_length=value_length,
        layer_bytes=tuple(layer_bytes),
        layer_params=tuple(layer_params),
        embedding_bytes=embedding_bytes,
        output_bytes=output_bytes,
        output_params=output_params,
        other_bytes=other_bytes,
        tensor_bytes=tensor_bytes,
        file_size=file_size,
        tied_embeddings=tied,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff=n_ff,
    )


def sha256_file(
    path: str | os.PathLike[str],
    progress: Callable[[int, int], None] | None = None,
    chunk_size: int = SHA256_CHUNK_BYTES,
) -> str:
    """Hex sha256 of a file read in chunks; progress(done_bytes, total_bytes) after each chunk."""
    total = os.path.getsize(path)
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


# Bytes per weight element of common GGUF quantisations (block overhead included).
QUANT_BYTES_PER_WEIGHT = {
    "F32": 4.0,
    "F16": 2.0,
    "BF16": 2.0,
    "Q8_0": 34 / 32,
    "Q6_K": 210 / 256,
    "Q5_K_M": 176 / 256,
    "Q4_K_M": 144 / 256,
    "Q4_1": 20 / 32,
    "Q4_0": 18 / 32,
    "Q3_K_M": 110 / 256,
    "Q2_K": 84 / 256,
}


def synthetic_profile(
    *,
    name: str = "synthetic",
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    quantization: str = "Q4_K_M",
    n_ctx_train: int = 8192,
    tied_embeddings: bool = False,
) -> ModelProfile:
    """A llama-shaped profile without a file, for scheduler tests and benchmarks."""
    bpw = QUANT_BYTES_PER_WEIGHT[quantization]
    head_dim = n_embd // n_head
    kv_dim = n_head_kv * head_dim
    layer_params = n_embd * (n_embd + 2 * kv_dim + n_embd) + 3 * n_embd * n_ff + 2 * n_embd
    layer_bytes = int(layer_params * bpw)
    embd_params = n_embd * n_vocab
    embd_bytes = int(embd_params * bpw)
    output_params = n_embd + (0 if tied_embeddings else embd_params)
    output_bytes = n_embd * 4 + (0 if tied_embeddings else int(embd_params * bpw))
    if tied_embeddings:
        output_bytes += embd_bytes
        output_params += embd_params
    tensor_bytes = n_layer * layer_bytes + embd_bytes + (0 if tied_embeddings else output_bytes)
    return ModelProfile(
        architecture="llama",
        name=name,
        quantization=quantization,
        file_type=None,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        key_length=head_dim,
        value_length=head_dim,
        layer_bytes=(layer_bytes,) * n_layer,
        layer_params=(layer_params,) * n_layer,
        embedding_bytes=embd_bytes,
        output_bytes=output_bytes,
        output_params=output_params,
        other_bytes=0,
        tensor_bytes=tensor_bytes,
        file_size=tensor_bytes + 4 * MIB_FOR_METADATA,
        tied_embeddings=tied_embeddings,
        n_ff=n_ff,
    )


MIB_FOR_METADATA = 1 << 20
