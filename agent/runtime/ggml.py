"""ctypes access to the ggml backend registry shipped inside llama-cpp-python.

The trap (FACTS.md): llama_cpp/lib holds *copies* (libggml.so, libggml.so.0, libggml.so.0.x.y),
not links. libllama was linked against the soname file, libggml.so.0, so that is the file to open:
dlopen dedupes by file identity, and any other copy would be a second ggml with its own registry,
where added RPC devices stay invisible to llama.cpp and every layer lands on the local CPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEV_TYPE_CPU = 0
DEV_TYPE_GPU = 1
DEV_TYPE_IGPU = 2
DEV_TYPE_ACCEL = 3
_TYPE_NAMES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class GgmlUnavailable(RuntimeError):
    pass


def llama_lib_dir() -> Path:
    """llama_cpp/lib, found without importing llama_cpp (the RPC worker never needs libllama)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlUnavailable("llama-cpp-python is not installed (pip install 'racon[agent]')")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not lib.is_dir():
        raise GgmlUnavailable(f"llama-cpp-python has no lib dir at {lib}")
    return lib


@dataclass
class DeviceInfo:
    index: int
    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "name": self.name,
            "description": self.description,
            "type": self.type,
            "memory_free": self.memory_free,
            "memory_total": self.memory_total,
        }


class Ggml:
    """The process's one ggml (the soname copy) and, when present, ggml-rpc."""

    def __init__(self, lib_dir: Path | None = None) -> None:
        lib_dir = lib_dir or llama_lib_dir()
        soname = lib_dir / "libggml.so.0"
        if not soname.exists():
            raise GgmlUnavailable(f"{soname} not found: llama-cpp-python layout changed?")
        # RTLD_GLOBAL so backends loaded later resolve their ggml symbols against this copy.
        self.lib = ctypes.CDLL(str(soname), mode=ctypes.RTLD_GLOBAL)
        base = lib_dir / "libggml-base.so.0"
        self.base = ctypes.CDLL(str(base), mode=ctypes.RTLD_GLOBAL) if base.exists() else self.lib
        rpc = lib_dir / "libggml-rpc.so.0"
        self.rpc = ctypes.CDLL(str(rpc), mode=ctypes.RTLD_GLOBAL) if rpc.exists() else None
        self._bind()

    def _fn(self, name: str, restype: object, argtypes: list[object]) -> Any:
        for lib in (self.lib, self.base, self.rpc):
            if lib is None:
                continue
            try:
                f = getattr(lib, name)
            except AttributeError:
                continue
            f.restype = restype
            f.argtypes = argtypes
            return f
        raise GgmlUnavailable(f"symbol {name} not found in llama-cpp-python's ggml")

    def _bind(self) -> None:
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        self.backend_load_all = self._fn("ggml_backend_load_all", None, [])
        self.dev_count = self._fn("ggml_backend_dev_count", sz, [])
        self.dev_get = self._fn("ggml_backend_dev_get", vp, [sz])
        self.dev_by_type = self._fn("ggml_backend_dev_by_type", vp, [ctypes.c_int])
        self.dev_name = self._fn("ggml_backend_dev_name", cp, [vp])
        self.dev_description = self._fn("ggml_backend_dev_description", cp, [vp])
        self.dev_type = self._fn("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_memory = self._fn(
            "ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        )

    # --- devices ------------------------------------------------------------------------------

    def device_info(self, index: int, dev: int) -> DeviceInfo:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return DeviceInfo(
            index=index,
            name=(self.dev_name(dev) or b"").decode(errors="replace"),
            description=(self.dev_description(dev) or b"").decode(errors="replace"),
            type=_TYPE_NAMES.get(int(self.dev_type(dev)), "other"),
            memory_free=int(free.value),
            memory_total=int(total.value),
        )

    def devices(self) -> list[DeviceInfo]:
        return [self.device_info(i, self.dev_get(i)) for i in range(int(self.dev_count()))]

    def local_devices_to_expose(self) -> list[int]:
        """The CPU plus every GPU (type 1) — what an RPC worker lends to the pool."""
        out: list[int] = []
        cpu = self.dev_by_type(DEV_TYPE_CPU)
        if cpu:
            out.append(cpu)
        for i in range(int(self.dev_count())):
            dev = self.dev_get(i)
            if int(self.dev_type(dev)) == DEV_TYPE_GPU:
                out.append(dev)
        return out

    # --- RPC ------------------------------------------------------------------------------------

    def start_rpc_server(
        self, endpoint: str, cache_dir: str | None, n_threads: int, devices: list[int]
    ) -> None:
        """Blocks for good while serving; returns only when the server could not start."""
        if self.rpc is None:
            raise GgmlUnavailable("llama-cpp-python was built without GGML_RPC=ON")
        f = self.rpc.ggml_backend_rpc_start_server
        f.restype = None
        f.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        arr = (ctypes.c_void_p * len(devices))(*devices)
        f(
            endpoint.encode(),
            cache_dir.encode() if cache_dir else None,
            n_threads,
            len(devices),
            arr,
        )
