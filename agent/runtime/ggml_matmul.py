"""One matrix product on one named device through the node's own llama.cpp build (ggml's graph
API over ctypes): the GPU speed challenge's work (agent/hardware/gpu_challenge.py).

Run in a child process (``main``), as the device scan is: initialising a backend creates a device
context (hundreds of MiB of VRAM on CUDA) that the agent must not keep, and a driver crash then
costs the challenge, not the agent. The device is selected by llama.cpp's name (``CUDA0``,
``Vulkan0``), so the work runs where the inventory says the GPU is; the backend's own variable
(GGML_VK_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES) is inherited from the agent.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent.hardware.gpu_challenge import answer_encode, challenge_inputs
from agent.runtime.ggml import Ggml, GgmlUnavailable, build_lib_dir

GGML_TYPE_F32 = 0
GGML_PREC_F32 = 10
GGML_PREC_F16 = 20
GGML_STATUS_SUCCESS = 0


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


class DeviceMatmul:
    """ggml's graph calls needed for ``mul_mat`` on one backend device."""

    def __init__(self, ggml: Ggml) -> None:
        self.ggml = ggml
        vp, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
        fn = ggml._fn
        self.init = fn("ggml_init", vp, [_InitParams])
        self.free = fn("ggml_free", None, [vp])
        self.tensor_overhead = fn("ggml_tensor_overhead", sz, [])
        self.graph_overhead = fn("ggml_graph_overhead", sz, [])
        self.new_tensor_2d = fn("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64])
        self.mul_mat = fn("ggml_mul_mat", vp, [vp, vp, vp])
        self.new_graph = fn("ggml_new_graph", vp, [vp])
        self.build_forward_expand = fn("ggml_build_forward_expand", None, [vp, vp])
        self.dev_by_name = fn("ggml_backend_dev_by_name", vp, [ctypes.c_char_p])
        self.dev_init = fn("ggml_backend_dev_init", vp, [vp, ctypes.c_char_p])
        self.backend_free = fn("ggml_backend_free", None, [vp])
        self.alloc_ctx_tensors = fn("ggml_backend_alloc_ctx_tensors", vp, [vp, vp])
        self.buffer_free = fn("ggml_backend_buffer_free", None, [vp])
        self.tensor_set = fn("ggml_backend_tensor_set", None, [vp, vp, sz, sz])
        self.tensor_get = fn("ggml_backend_tensor_get", None, [vp, vp, sz, sz])
        self.graph_compute = fn("ggml_backend_graph_compute", ctypes.c_int, [vp, vp])
        self.synchronize = fn("ggml_backend_synchronize", None, [vp])
        # Ask for float32 accumulation where the build can be told (newer ggml: ggml_prec_set_acc;
        # older: ggml_mul_mat_set_prec). The inputs are exact in any float type either way.
        self.set_acc: Any = self._optional("ggml_prec_set_acc", ctypes.c_bool, [vp, ctypes.c_int])
        if self.set_acc is None:
            self.set_acc = self._optional("ggml_mul_mat_set_prec", None, [vp, ctypes.c_int])
        # Never quantize the inputs below float16 (a Q8 scale of 1/127 is not exact).
        self.set_src: Any = self._optional(
            "ggml_prec_set_src", ctypes.c_bool, [vp, ctypes.c_int, ctypes.c_int]
        )

    def _optional(self, name: str, restype: object, argtypes: list[object]) -> Any:
        try:
            return self.ggml._fn(name, restype, argtypes)
        except GgmlUnavailable:
            return None

    def product(self, device: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``b @ a.T`` (float32) computed by ggml's mul_mat on ``device``."""
        n, k = a.shape
        m, k2 = b.shape
        if k != k2:
            raise ValueError(f"inner sizes differ: {k} and {k2}")
        dev = self.dev_by_name(device.encode())
        if not dev:
            names = ", ".join(d.name for d in self.ggml.devices())
            raise GgmlUnavailable(f"no device {device} in this llama.cpp build (it has: {names})")
        backend = self.dev_init(dev, None)
        if not backend:
            raise GgmlUnavailable(f"{device}: the backend could not be initialised")
        params = _InitParams(
            mem_size=int(self.tensor_overhead()) * 8 + int(self.graph_overhead()),
            mem_buffer=None,
            no_alloc=True,
        )
        ctx = self.init(params)
        buf = None
        try:
            ta = self.new_tensor_2d(ctx, GGML_TYPE_F32, k, n)
            tb = self.new_tensor_2d(ctx, GGML_TYPE_F32, k, m)
            tc = self.mul_mat(ctx, ta, tb)  # ne = [n, m]: m rows of n
            if self.set_acc is not None:
                self.set_acc(tc, GGML_PREC_F32)
            if self.set_src is not None:
                self.set_src(tc, GGML_PREC_F16, 1)  # ggml takes a rank for src[1] only
            graph = self.new_graph(ctx)
            self.build_forward_expand(graph, tc)
            buf = self.alloc_ctx_tensors(ctx, backend)
            if not buf:
                raise GgmlUnavailable(f"{device}: could not allocate {4 * k * (m + n)} bytes")
            fa = np.ascontiguousarray(a, dtype=np.float32)
            fb = np.ascontiguousarray(b, dtype=np.float32)
            self.tensor_set(ta, fa.ctypes.data, 0, fa.nbytes)
            self.tensor_set(tb, fb.ctypes.data, 0, fb.nbytes)
            status = int(self.graph_compute(backend, graph))
            if status != GGML_STATUS_SUCCESS:
                raise GgmlUnavailable(f"{device}: graph compute failed (status {status})")
            self.synchronize(backend)
            out = np.empty((m, n), dtype=np.float32)
            self.tensor_get(tc, out.ctypes.data, 0, out.nbytes)
            return out
        finally:
            if buf:
                self.buffer_free(buf)
            self.free(ctx)
            self.backend_free(backend)


def challenge_answer(
    *, device: str, seed: int, m: int, n: int, k: int, lib_dir: Path | None = None
) -> str:
    """The GPU challenge's answer, computed on ``device`` in this process."""
    ggml = Ggml(lib_dir or build_lib_dir())
    ggml.load_backends()
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    return answer_encode(DeviceMatmul(ggml).product(device, a, b))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -c 'from agent.runtime.ggml_matmul import main; main()' '<json>'``: one JSON line,
    {"answer"} or {"error"}; the arguments are {"device", "seed", "m", "n", "k"}."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        req = json.loads(args[0])
        answer = challenge_answer(
            device=str(req["device"]),
            seed=int(req["seed"]),
            m=int(req["m"]),
            n=int(req["n"]),
            k=int(req["k"]),
        )
    except (GgmlUnavailable, OSError, ValueError, KeyError, IndexError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 0
    print(json.dumps({"answer": answer}))
    return 0


# Not `-m`: the package imports this module first, and runpy warns.
_CHILD = "import sys; from agent.runtime.ggml_matmul import main; sys.exit(main())"


def run_child(request: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """``main`` in a child process: {"answer"} or {"error"} (a crash or a timeout included)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(request)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the product on {request.get('device')} took over {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"the challenge's process exited {proc.returncode}: {proc.stderr[-300:]}"}
    try:
        got: dict[str, Any] = json.loads(lines[-1])
    except ValueError:
        return {"error": f"the challenge's process wrote no answer: {lines[-1][-200:]}"}
    return got
