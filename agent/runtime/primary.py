"""The llama.cpp primary, agent side: plan checks, and reading where a load put every layer.

The primary itself is a supervised llama-server process (agent/runtime/server.py): the ggml
backend registry is process-wide and cannot be undone (a new plan needs a new process), and when
an RPC peer dies llama.cpp aborts the whole process (exit 134). The agent must survive that.
"""

from __future__ import annotations

import math
import re
import signal
from typing import Any, cast

from agent.protocol import (
    LoadPrimaryPayload,
    PublicAddressError,
    is_private_address,
    split_endpoint,
)
from agent.tunnel import TunnelTls

LAYER_RE = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
BUFFER_RE = re.compile(r"(\S+) (model|KV|compute) buffer size =\s*([\d.]+) MiB")
N_LAYER_RE = re.compile(r"n_layer\s*=\s*(\d+)")
RPC_CRASH_MARKERS = ("Remote RPC server crashed", "Failed to connect to", "RPC handshake failed")
MAX_DEVICES = 16  # llama.cpp's LLAMA_MAX_DEVICES


class PlanError(ValueError):
    """A load_primary plan this node refuses; the message says why, for the operator, and
    ``code`` says which way for the controller (protocol 2: no error is classified by its text):
    ``malformed_plan``, ``model_missing``, ``sha256_mismatch`` or ``out_of_memory``."""

    def __init__(self, message: str, *, code: str = "malformed_plan") -> None:
        super().__init__(message)
        self.code = code


_DEVICE_NAME = re.compile(r"^[A-Za-z][A-Za-z_]{0,15}[0-9]{0,3}$")


def validate_plan_shape(payload: dict[str, Any]) -> LoadPrimaryPayload:
    """Types and ranges of a load_primary payload. Raises PlanError / PublicAddressError."""

    def need(key: str, types: type | tuple[type, ...]) -> Any:
        if key not in payload:
            raise PlanError(f"malformed load_primary: missing {key!r}")
        value = payload[key]
        if not isinstance(value, types) or isinstance(value, bool) and types is not bool:
            raise PlanError(f"malformed load_primary: {key!r} has the wrong type")
        return value

    need("deployment_id", str)
    need("model_name", str)
    sha = need("sha256", str)
    if len(sha) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha):
        raise PlanError("malformed load_primary: 'sha256' must be 64 hex digits")
    endpoints = need("rpc_endpoints", list)
    split = need("tensor_split", list)
    need("n_gpu_layers", int)
    n_ctx = need("n_ctx", int)
    need("n_parallel", int)
    n_threads = need("n_threads", int)
    if n_ctx < 0 or n_threads < 0:
        raise PlanError("malformed load_primary: n_ctx and n_threads must be >= 0")
    for ep in endpoints:
        if not isinstance(ep, str):
            raise PlanError("malformed load_primary: rpc_endpoints must be 'host:port' strings")
        try:
            host, _ = split_endpoint(ep)
        except ValueError as exc:
            raise PlanError(f"malformed load_primary: {exc}") from None
        if not is_private_address(host):
            raise PublicAddressError(host)
    if len(endpoints) > MAX_DEVICES - 1:
        raise PlanError(
            f"plan names {len(endpoints)} RPC workers; llama.cpp allows {MAX_DEVICES - 1}"
        )
    for v in split:
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise PlanError("malformed load_primary: tensor_split entries must be numbers >= 0")
    if len(split) > MAX_DEVICES:
        raise PlanError(f"tensor_split has {len(split)} entries; llama.cpp allows {MAX_DEVICES}")
    names = payload.get("offload_devices")
    if names is not None and (
        not isinstance(names, list)
        or not all(isinstance(n, str) and _DEVICE_NAME.match(n) for n in names)
        or len(names) != len(split)
    ):
        raise PlanError(
            "malformed load_primary: 'offload_devices' must be llama.cpp device names "
            "(RPC0, Vulkan0, CUDA0), one per tensor_split entry"
        )
    mem = payload.get("memory_bytes")
    if mem is not None and (not isinstance(mem, int) or isinstance(mem, bool) or mem < 0):
        raise PlanError("malformed load_primary: 'memory_bytes' must be an integer >= 0")
    key = payload.get("rpc_tunnel_key")
    if key is not None and (
        not isinstance(key, str) or len(key) < 32 or any(c not in "0123456789abcdef" for c in key)
    ):
        raise PlanError("malformed load_primary: 'rpc_tunnel_key' must be hex, at least 16 bytes")
    if key is not None and payload.get("rpc_endpoints"):
        try:
            TunnelTls.from_wire(payload.get("rpc_tunnel_tls"))
        except ValueError as exc:
            raise PlanError(f"malformed load_primary: 'rpc_tunnel_tls': {exc}") from None
    mp = payload.get("model_path")
    if mp is not None and not isinstance(mp, str):
        raise PlanError("malformed load_primary: 'model_path' must be a string")
    engine = payload.get("engine", "llamacpp")
    if engine not in ("llamacpp", "vllm"):
        raise PlanError("malformed load_primary: 'engine' must be 'llamacpp' or 'vllm'")
    if engine == "vllm" and (payload.get("rpc_endpoints") or not mp):
        raise PlanError(
            "malformed load_primary: a vLLM plan runs on one node (no rpc_endpoints) and names "
            "its model directory (model_path)"
        )
    kv = payload.get("kv_bytes")
    if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 0):
        raise PlanError("malformed load_primary: 'kv_bytes' must be an integer >= 0")
    return cast("LoadPrimaryPayload", payload)  # its fields checked one by one above


def check_memory(plan: LoadPrimaryPayload, memory_total: int) -> None:
    need = plan.get("memory_bytes")
    if need is not None and memory_total > 0 and need > memory_total:
        raise PlanError(
            f"plan needs {need / 2**30:.2f} GiB on the primary but this machine has "
            f"{memory_total / 2**30:.2f} GiB of RAM; refusing to load",
            code="out_of_memory",
        )


def buffer_device(buffer: str, devices: list[dict[str, Any]]) -> str:
    """The device a buffer belongs to.

    RPC buffer names carry the server-local device index and the endpoint ("RPC0[10.0.0.5:50052]"
    for the first device of *every* server), while device names are numbered across servers
    (RPC0, RPC1, ...); match by endpoint, then by position within that server.
    """
    name, _, rest = buffer.partition("[")
    if not rest or not name.startswith("RPC"):
        return "CPU" if name.startswith("CPU") else name
    endpoint = rest.rstrip("]")
    local = int(name[3:]) if name[3:].isdigit() else 0
    same_server = [d["name"] for d in devices if d.get("description") == endpoint]
    return same_server[local] if local < len(same_server) else name


def summarize_assignment(
    layers: dict[int, str], devices: list[dict[str, Any]], buffers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per device: which layers it holds, and its model/KV/compute buffers (MiB)."""
    by_dev: dict[str, list[int]] = {}
    for layer, dev in sorted(layers.items()):
        by_dev.setdefault(dev, []).append(layer)
    desc = {d["name"]: d for d in devices}
    out: list[dict[str, Any]] = []
    for dev, ls in by_dev.items():
        info = desc.get(dev, {})
        entry: dict[str, Any] = {
            "device": dev,
            "description": info.get("description", ""),
            # RPC device descriptions are the worker endpoint ("host:port").
            "endpoint": info.get("description") if dev.startswith("RPC") else None,
            "layers": ls,
            "first_layer": ls[0],
            "last_layer": ls[-1],
            "n_layers": len(ls),
        }
        for b in buffers:
            if buffer_device(b["buffer"], devices) == dev:
                key = f"{b['kind'].lower()}_buffer_mib"
                entry[key] = round(entry.get(key, 0.0) + b["mib"], 2)
        out.append(entry)
    return out


def describe_exit(code: int | None) -> str:
    if code is None:
        return "vanished"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "aborted (SIGABRT)" if code == -6 else f"was killed by {name}"
    if code == 134:
        return "aborted (exit 134)"
    return f"exited with code {code}"
