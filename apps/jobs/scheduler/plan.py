"""The scheduler's outputs: a plan in llama.cpp's device order, or a refusal that says why."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from racon.ids import NodeId

from .inputs import GiB, MiB


@dataclass(frozen=True)
class PlanDevice:
    """One device of a plan, in llama.cpp's layer order; endpoint None means the primary itself."""

    node_id: NodeId
    device: str
    kind: str
    layer_start: int
    layer_end: int  # exclusive
    memory_bytes: int  # weights + KV + compute buffer (+ embeddings/output) + safety margin
    endpoint: str | None
    holds_output: bool = False
    free_bytes: int = 0
    # The prediction's share of this device: ms per decoded token for its layers (and the output
    # when it holds it), and the figures it was planned at (an unverified GPU's are the floor).
    decode_ms: float = 0.0
    gflops: float = 0.0
    mem_bandwidth_gbps: float = 0.0

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["n_layers"] = self.n_layers
        # The rate this device would sustain for its share alone (the plan's is the sum of times).
        d["tokens_per_s"] = round(1000.0 / self.decode_ms, 2) if self.decode_ms > 0 else None
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanDevice:
        """Inverse of to_dict (derived keys ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Plan:
    """Where a model runs, how llama.cpp is told so, and what we predict for it."""

    primary_node_id: str
    devices: tuple[PlanDevice, ...]
    tensor_split: tuple[float, ...]
    n_gpu_layers: int
    n_threads: int
    n_ctx: int
    n_parallel: int
    n_batch: int
    flash_attn: bool
    predicted_ttft_ms: float
    predicted_tokens_per_s: float
    explanation: tuple[str, ...]
    # The engine that serves the plan (issue 30), and for vLLM the KV cache it is given (bytes).
    engine: str = "llamacpp"
    kv_bytes: int = 0

    @property
    def node_ids(self) -> tuple[str, ...]:
        """Nodes that hold layers or the model's host side, in plan order, without repeats."""
        seen: dict[str, None] = {}
        for d in self.devices:
            if d.n_layers > 0 or d.endpoint is None:
                seen.setdefault(d.node_id, None)
        return tuple(seen)

    @property
    def layer_devices(self) -> tuple[PlanDevice, ...]:
        return tuple(d for d in self.devices if d.n_layers > 0)

    @property
    def rpc_endpoints(self) -> tuple[str, ...]:
        """Endpoints the primary registers, in order (ggml_backend_rpc_add_server)."""
        seen: dict[str, None] = {}
        for d in self.devices:
            if d.endpoint is not None:
                seen.setdefault(d.endpoint, None)
        return tuple(seen)

    def rpc_workers(self) -> list[dict[str, Any]]:
        """Per remote node: endpoint and the devices its worker must expose, in plan order."""
        out: dict[str, dict[str, Any]] = {}
        for d in self.devices:
            if d.endpoint is None:
                continue
            w = out.setdefault(
                d.node_id, {"node_id": d.node_id, "endpoint": d.endpoint, "devices": []}
            )
            w["devices"].append(d.device)
        return list(out.values())

    def offload_device_names(self, exposed: Mapping[str, Sequence[str]] | None = None) -> list[str]:
        """llama.cpp's names for the offload devices (every device after the primary's CPU), in
        tensor_split order: llama-server's --device. A worker's device is RPC<k>, with k counting
        every device the workers expose, endpoint by endpoint in --rpc order (ggml-rpc numbers
        them so); the primary's own GPUs keep their names (Vulkan0, CUDA0). ``exposed`` is each
        worker's device list as it reported it (rpc_start); unknown, its plan devices in order."""
        base: dict[str, tuple[int, list[str]]] = {}
        k = 0
        for w in self.rpc_workers():
            names = list((exposed or {}).get(w["node_id"]) or w["devices"])
            base[w["node_id"]] = (k, names)
            k += len(names)
        out = []
        for d in self.devices[1:]:
            if d.endpoint is None:
                out.append(d.device)
                continue
            start, names = base[d.node_id]
            if d.device not in names:
                raise ValueError(
                    f"the RPC worker on {d.node_id} does not expose {d.device} (it has {names})"
                )
            out.append(f"RPC{start + names.index(d.device)}")
        return out

    def memory_by_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.devices:
            out[d.node_id] = out.get(d.node_id, 0) + d.memory_bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "primary_node_id": self.primary_node_id,
            "devices": [d.to_dict() for d in self.devices],
            "rpc_endpoints": list(self.rpc_endpoints),
            "tensor_split": list(self.tensor_split),
            "n_gpu_layers": self.n_gpu_layers,
            "n_threads": self.n_threads,
            "n_ctx": self.n_ctx,
            "n_parallel": self.n_parallel,
            "n_batch": self.n_batch,
            "flash_attn": self.flash_attn,
            "predicted_ttft_ms": self.predicted_ttft_ms,
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "explanation": list(self.explanation),
            "engine": self.engine,
            "kv_bytes": self.kv_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of to_dict, for a plan stored as JSON (derived keys ignored)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["devices"] = tuple(PlanDevice.from_dict(d) for d in data["devices"])
        kwargs["tensor_split"] = tuple(float(x) for x in data["tensor_split"])
        kwargs["explanation"] = tuple(data.get("explanation", ()))
        return cls(**kwargs)


class PlacementRefused(Exception):
    """No plan satisfies the request; reason is meant for the operator as is.

    code tells callers the kind apart without reading the words: "no_capacity" (memory or
    nodes), "invalid_request" (bad input) and "n_parallel_too_large" (limit: the slots that fit).
    """

    def __init__(
        self,
        reason: str,
        missing_bytes: int = 0,
        best_set: Sequence[str] = (),
        *,
        code: str = "no_capacity",
        limit: int | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing_bytes = int(missing_bytes)
        self.best_set = tuple(best_set)
        self.code = code
        self.limit = limit

    @property
    def bad_input(self) -> bool:
        """The request itself is wrong (an HTTP 400), not the cluster too small (a 422)."""
        return self.code in ("invalid_request", "n_parallel_too_large")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "reason": self.reason,
            "missing_bytes": self.missing_bytes,
            "best_set": list(self.best_set),
            "refusal": self.code,
        }
        if self.limit is not None:
            d["limit"] = self.limit
        return d


def fmt_bytes(n: float) -> str:
    """Human size in GiB (or MiB below one GiB), as refusals and explanations print it."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB"
