"""ctypes access to the ggml backend registry shipped inside llama-cpp-python.

The trap (FACTS.md): llama_cpp/lib holds *copies* (libggml.so, libggml.so.0, libggml.so.0.x.y),
not links. libllama was linked against the soname file, libggml.so.0, so that is the file to open:
dlopen dedupes by file identity, and any other copy would be a second ggml with its own registry,
where added RPC devices stay invisible to llama.cpp and every layer lands on the local CPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
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


def build_lib_dir() -> Path | None:
    """lib/ of the llama.cpp build the agent runs (the venv's llama.cpp link, scripts/install-llama.sh,
    or RACON_LLAMA_SERVER's build): where a GPU build keeps its backend modules."""
    explicit = os.environ.get("RACON_LLAMA_SERVER")
    server = Path(explicit) if explicit else Path(sys.prefix) / "llama.cpp" / "bin" / "llama-server"
    lib = server.resolve().parent.parent / "lib"
    return lib if (lib / "libggml.so.0").exists() else None


class _Caps(ctypes.Structure):
    _fields_ = [
        ("async_", ctypes.c_bool),
        ("host_buffer", ctypes.c_bool),
        ("buffer_from_host_ptr", ctypes.c_bool),
        ("events", ctypes.c_bool),
    ]


class _Props(ctypes.Structure):
    """struct ggml_backend_dev_props (ggml-backend.h)."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", _Caps),
    ]


@dataclass
class DeviceInfo:
    index: int
    name: str  # llama.cpp's device name: CPU, CUDA0, Vulkan0, Metal, ROCm0, RPC0
    description: str
    type: str
    memory_free: int
    memory_total: int
    backend: str = ""  # the backend's registry name: CPU, CUDA, Vulkan, Metal, ROCm, RPC
    device_id: str = ""  # the PCI bus id where the backend knows it

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "name": self.name,
            "description": self.description,
            "type": self.type,
            "memory_free": self.memory_free,
            "memory_total": self.memory_total,
            "backend": self.backend,
            "device_id": self.device_id,
        }


class Ggml:
    """The process's one ggml (the soname copy) and, when present, ggml-rpc."""

    def __init__(self, lib_dir: Path | None = None) -> None:
        lib_dir = lib_dir or llama_lib_dir()
        self.lib_dir = lib_dir
        self._loaded = False
        soname = lib_dir / "libggml.so.0"
        if not soname.exists():
            raise GgmlUnavailable(f"{soname} not found: llama-cpp-python layout changed?")
        # RTLD_GLOBAL so backends loaded later resolve their ggml symbols against this copy.
        self.lib = ctypes.CDLL(str(soname), mode=ctypes.RTLD_GLOBAL)
        base = lib_dir / "libggml-base.so.0"
        self.base = ctypes.CDLL(str(base), mode=ctypes.RTLD_GLOBAL) if base.exists() else self.lib
        # A CPU-only build links ggml-rpc as libggml-rpc.so.0; a GPU build (GGML_BACKEND_DL) has it
        # as a module, registered by load_backends and reached through the registry.
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
        self._load_all = self._fn("ggml_backend_load_all", None, [])
        try:
            self._load_all_from_path: Any = self._fn("ggml_backend_load_all_from_path", None, [cp])
        except GgmlUnavailable:
            self._load_all_from_path = None
        self.reg_count = self._fn("ggml_backend_reg_count", sz, [])
        self.reg_by_name = self._fn("ggml_backend_reg_by_name", vp, [cp])
        self.reg_name = self._fn("ggml_backend_reg_name", cp, [vp])
        self.reg_proc = self._fn("ggml_backend_reg_get_proc_address", vp, [vp, cp])
        self.dev_reg = self._fn("ggml_backend_dev_backend_reg", vp, [vp])
        self.dev_props = self._fn("ggml_backend_dev_get_props", None, [vp, ctypes.POINTER(_Props)])
        self.dev_count = self._fn("ggml_backend_dev_count", sz, [])
        self.dev_get = self._fn("ggml_backend_dev_get", vp, [sz])
        self.dev_by_type = self._fn("ggml_backend_dev_by_type", vp, [ctypes.c_int])
        self.dev_name = self._fn("ggml_backend_dev_name", cp, [vp])
        self.dev_description = self._fn("ggml_backend_dev_description", cp, [vp])
        self.dev_type = self._fn("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_memory = self._fn(
            "ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        )

    def load_backends(self) -> None:
        """Register every backend of the build, once. A GPU build (GGML_BACKEND_DL) starts with an
        empty registry and keeps its backends as modules in lib/, where ggml's own search (beside
        the executable, the working directory) does not look from a Python process; a CPU-only
        build has CPU and RPC linked in, and ggml's own search adds any out-of-tree module."""
        if self._loaded:
            return
        self._loaded = True
        if int(self.reg_count()) == 0 and self._load_all_from_path is not None:
            self._load_all_from_path(str(self.lib_dir).encode())
        else:
            self._load_all()

    # ggml_backend_load_all's name, kept for callers (the RPC worker): the build's own modules.
    backend_load_all = load_backends

    # --- devices ------------------------------------------------------------------------------

    def device_info(self, index: int, dev: int) -> DeviceInfo:
        props = _Props()
        self.dev_props(dev, ctypes.byref(props))
        reg = self.dev_reg(dev)
        return DeviceInfo(
            index=index,
            name=(props.name or b"").decode(errors="replace"),
            description=(props.description or b"").decode(errors="replace"),
            type=_TYPE_NAMES.get(int(props.type), "other"),
            memory_free=int(props.memory_free),
            memory_total=int(props.memory_total),
            backend=(self.reg_name(reg) or b"").decode(errors="replace") if reg else "",
            device_id=(props.device_id or b"").decode(errors="replace"),
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
        argtypes: list[Any] = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        f: Any
        if self.rpc is not None:
            f = self.rpc.ggml_backend_rpc_start_server
            f.restype = None
            f.argtypes = argtypes
        else:
            self.load_backends()
            reg = self.reg_by_name(b"RPC")
            addr = self.reg_proc(reg, b"ggml_backend_rpc_start_server") if reg else None
            if not addr:
                raise GgmlUnavailable("this llama.cpp build has no ggml-rpc (GGML_RPC=ON)")
            f = ctypes.CFUNCTYPE(None, *argtypes)(addr)
        arr = (ctypes.c_void_p * len(devices))(*devices)
        f(
            endpoint.encode(),
            cache_dir.encode() if cache_dir else None,
            n_threads,
            len(devices),
            arr,
        )


def load_llama_cpp_backends() -> None:
    """Before llama_cpp's own calls in this process (llama_supports_rpc, Llama): register the
    backends of the llama_cpp/lib copy it loads, which a GPU build's libllama cannot find itself
    from a Python process. Harmless on a CPU-only build; silent when llama_cpp is missing."""
    try:
        Ggml(llama_lib_dir()).load_backends()
    except (GgmlUnavailable, OSError):
        pass


# --- the device list, read in a child process -------------------------------------------------------


def list_devices(lib_dir: Path | None = None) -> list[DeviceInfo]:
    """Every device of the build's backends, as ggml lists them (this process loads them: a CUDA
    or Vulkan context then lives here, so the agent calls it through a child: agent/hardware)."""
    ggml = Ggml(lib_dir or build_lib_dir())
    ggml.load_backends()
    return ggml.devices()


def main(argv: list[str] | None = None) -> int:
    """`python -c 'from agent.runtime.ggml import main; main()'`: the device list as one JSON line."""
    try:
        devices = [d.as_dict() for d in list_devices()]
    except (GgmlUnavailable, OSError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 0
    print(json.dumps({"devices": devices}))
    return 0
