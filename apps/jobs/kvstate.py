"""A saved llama.cpp slot, read before it is restored anywhere (issue 28). Pure: no ORM, no I/O
beyond the file it is given.

The old primary uploads whatever it likes; the controller forwards it into another contributor's
llama-server only once the file parses as llama.cpp's sequence-state format to its last byte and
agrees with what the controller knows: the model's layer count, its KV bytes per token, and the
token count of the controller's own ownership record. The format, from the vendored llama.cpp
(src/llama-context.cpp ``state_seq_save_file``; src/llama-kv-cache.cpp ``state_write``,
``state_write_meta``, ``state_write_data``), little-endian:

    u32 magic 'ggsq' (0x67677371), u32 version (3)
    u32 n_token, i32 token[n_token]                      the prompt the slot holds; llama-server
        writes its own packing there (tools/server server-common.cpp, server_tokens::serialize):
        i32 -1, u32 version (1), u32 n, i32 token[n], u32 m, u32 media key[m], media chunks
    u32 n_stream                                         one per slot (--no-kv-unified)
    per stream: u32 cell_count; when > 0:
        per cell: i32 pos, u32 n_seq_id, [12 bytes ext: M-RoPE/PLE models], i32 seq_id[n_seq_id]
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_size_row, k_size_row × cell_count bytes
        v_trans = 0: per layer: i32 v_type, u64 v_size_row, v_size_row × cell_count bytes
        v_trans = 1: per layer: i32 v_type, u32 v_size_el, u32 n_embd_v_gqa,
                     v_size_el × n_embd_v_gqa × cell_count bytes
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

GGSQ = 0x67677371
SEQ_VERSION = 3
_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok
_MAX_STREAMS = 4096
_MAX_SEQ_IDS = 4096
_SERVER_TOKENS = 0xFFFFFFFF  # LLAMA_TOKEN_NULL as u32: llama-server's packed token list
_SERVER_TOKENS_VERSION = 1


class KvStateInvalid(ValueError):
    """The file is not a saved slot that may be restored here; the message says which field."""


@dataclass(frozen=True)
class KvStateHeader:
    n_tokens: int  # the prompt's tokens (inside llama-server's packing when it wrote one)
    n_cells: int
    n_layer: int  # 0 when no stream holds cells
    bytes_per_token: int  # K and V bytes one cell holds over all layers
    size: int


class _Reader:
    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.size, self.pos = fh, size, 0

    def take(self, fmt: str, what: str) -> tuple[int, ...]:
        n = struct.calcsize(fmt)
        raw = self.fh.read(n)
        if len(raw) != n:
            raise KvStateInvalid(f"the file ends inside {what} (at byte {self.pos} of {self.size})")
        self.pos += n
        return struct.unpack(fmt, raw)

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise KvStateInvalid(
                f"{what} claims {n} bytes at byte {self.pos}, past the file's {self.size}"
            )
        self.fh.seek(n, os.SEEK_CUR)
        self.pos += n


def _cells(r: _Reader, count: int, ext: int) -> None:
    for i in range(count):
        _pos, n_seq = r.take("<iI", f"cell {i}")
        if n_seq > _MAX_SEQ_IDS:
            raise KvStateInvalid(f"cell {i} claims {n_seq} sequences")
        r.skip(ext + 4 * n_seq, f"cell {i}'s sequences")


def _layers(r: _Reader, cells: int) -> tuple[int, int]:
    v_trans, n_layer = r.take("<II", "the layer header")
    if v_trans not in (0, 1):
        raise KvStateInvalid(f"v_trans is {v_trans}, not 0 or 1")
    per_token = 0
    for il in range(n_layer):
        _k_type, k_row = r.take("<iQ", f"layer {il}'s K header")
        r.skip(k_row * cells, f"layer {il}'s K rows")
        per_token += k_row
    for il in range(n_layer):
        if v_trans:
            _v_type, el, n_embd = r.take("<iII", f"layer {il}'s V header")
            row = el * n_embd
        else:
            _v_type, row = r.take("<iQ", f"layer {il}'s V header")
        r.skip(row * cells, f"layer {il}'s V rows")
        per_token += row
    return n_layer, per_token


def _tokens(r: _Reader, n_words: int) -> int:
    """The prompt's token count from the token list's ``n_words`` words (the reader moves past them)."""
    start = r.pos
    if n_words < 4:
        r.skip(4 * n_words, "the token list")
        return n_words
    marker, version, count = r.take("<III", "the token list")
    if marker != _SERVER_TOKENS:
        r.skip(4 * (n_words - 3), "the token list")
        return n_words
    if version != _SERVER_TOKENS_VERSION:
        raise KvStateInvalid(
            f"llama-server's token list version {version}, this controller reads 1"
        )
    if 4 + count > n_words:
        raise KvStateInvalid(f"the token list claims {count} tokens in {n_words} words")
    r.skip(4 * count, "the token list")
    (media,) = r.take("<I", "the token list's media count")
    if media:
        raise KvStateInvalid(f"the state holds {media} media chunks: a text slot was expected")
    r.skip(start + 4 * n_words - r.pos, "the token list")
    return count


def _parse(fh: BinaryIO, size: int, ext: int) -> KvStateHeader:
    r = _Reader(fh, size)
    magic, version = r.take("<II", "the header")
    if magic != GGSQ:
        raise KvStateInvalid(f"not a llama.cpp slot save: magic {magic:#010x}, not 'ggsq'")
    if version != SEQ_VERSION:
        raise KvStateInvalid(
            f"sequence state version {version}, this controller reads {SEQ_VERSION}"
        )
    (n_words,) = r.take("<I", "the token count")
    n_tokens = _tokens(r, n_words)
    (n_stream,) = r.take("<I", "the stream count")
    if not 1 <= n_stream <= _MAX_STREAMS:
        raise KvStateInvalid(f"{n_stream} streams")
    n_cells = n_layer = per_token = 0
    for s in range(n_stream):
        (cells,) = r.take("<I", f"stream {s}'s cell count")
        if not cells:
            continue
        if n_cells:
            raise KvStateInvalid("more than one stream holds cells: not one slot's sequence")
        _cells(r, cells, ext)
        n_layer, per_token = _layers(r, cells)
        n_cells = cells
    if r.pos != size:
        raise KvStateInvalid(f"{size - r.pos} bytes after the end of the saved state")
    return KvStateHeader(n_tokens, n_cells, n_layer, per_token, size)


def kv_state_read(fh: BinaryIO) -> KvStateHeader:
    """Parse a saved slot to its end (KvStateInvalid names what does not parse). Models with a
    cell extension (M-RoPE, PLE) write 12 more bytes per cell: tried when the plain read fails."""
    size = fh.seek(0, os.SEEK_END)
    first: KvStateInvalid | None = None
    for ext in (0, _EXT_BYTES):
        fh.seek(0)
        try:
            return _parse(fh, size, ext)
        except KvStateInvalid as exc:
            first = first or exc
            if "magic" in str(exc) or "version" in str(exc):
                break
    assert first is not None
    raise first


# A slot holds its conversation's tokens less the last one sampled, which is never decoded.
TOKEN_SLACK = 2


def kv_state_check(
    header: KvStateHeader, *, tokens: int, n_layer: int, bytes_per_token: int
) -> None:
    """Refuse a state that does not match what the controller knows (KvStateInvalid): the token
    count of its ownership record (``tokens``), the model's layers and KV bytes per token (each
    checked when known, > 0)."""
    if not tokens - TOKEN_SLACK <= header.n_tokens <= tokens:
        raise KvStateInvalid(
            f"the state holds {header.n_tokens} tokens; the controller's ownership record has "
            f"{tokens}"
        )
    if header.n_cells > header.n_tokens or header.n_cells == 0:
        raise KvStateInvalid(
            f"the state holds {header.n_cells} KV cells for {header.n_tokens} tokens"
        )
    if n_layer > 0 and header.n_layer != n_layer:
        raise KvStateInvalid(f"the state has {header.n_layer} layers; the model has {n_layer}")
    if bytes_per_token > 0 and header.bytes_per_token != bytes_per_token:
        raise KvStateInvalid(
            f"the state holds {header.bytes_per_token} KV bytes per token; the model's f16 KV "
            f"cache holds {bytes_per_token}"
        )
