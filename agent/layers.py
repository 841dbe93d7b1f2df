"""llama.cpp's layer → device rule, replayed in pure Python.

One copy for both sides: the scheduler checks its plans against it (apps/jobs/scheduler/), and
the agent names the device of every layer of a loaded llama-server, which logs those lines only at
debug verbosity (agent/runtime/server.py). No Django, no llama.cpp: stdlib only.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def llama_layer_assignment(
    n_layer: int, n_gpu_layers: int, tensor_split: Sequence[float]
) -> tuple[list[int], int]:
    """Replay llama.cpp's layer → device rule: (device index per layer, output's device).

    -1 is the primary's CPU; i >= 0 indexes the offload devices (tensor_split entries). Mirrors
    llama_model::load_tensors: float32 split points, upper_bound on (il - i_gpu_start) / act.
    """
    n_dev = len(tensor_split)
    splits: list[float] = []
    acc = _f32(0.0)
    for s in tensor_split:
        acc = _f32(acc + _f32(s))
        splits.append(acc)
    if n_dev and acc > 0:
        splits = [_f32(s / acc) for s in splits]
    i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)
    act = 0 if n_dev == 0 else min(n_gpu_layers, n_layer + 1)

    def dev_of(il: int) -> int:
        if il < i_gpu_start or (il - i_gpu_start) >= act:
            return -1
        x = _f32(float(il - i_gpu_start) / act)
        # std::upper_bound: first split point strictly greater than x.
        for i, s in enumerate(splits):
            if s > x:
                return i
        return n_dev  # llama.cpp would index past the end; a broken split

    return [dev_of(il) for il in range(n_layer)], dev_of(n_layer)
