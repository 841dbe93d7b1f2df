"""Heterogeneous placement: model profile + cluster snapshot + request → plan, or a clear refusal.

Pure package (no ORM; only the node states' names from apps.nodes.states): the controller builds
the snapshots from its rows and calls ``plan_placement``. The modules, in the order data flows:

- ``inputs``: the cluster snapshot and the request; ``cost``: the cost model (memory and latency);
- ``eligibility``: which nodes a request may use; ``evaluate``: the per-decision model of the
  cluster and the scoring of one candidate set (the hot loop); ``search``: ``plan_placement``;
- ``assemble`` and ``explain``: the chosen candidate as a ``Plan`` (``plan``) and its reasons;
- ``reference``: ``exhaustive_best`` and ``memory_proportional_plan``, for tests and
  ``bench/scheduler.py`` only: import them from ``apps.jobs.scheduler.reference`` (the package
  does not load them).

The contract with the agent runtime (llama.cpp + ggml-rpc), checked against llama.cpp's source
(src/llama.cpp device selection, src/llama-model.cpp layer assignment):

- llama.cpp's offload device list is: every RPC device, in endpoint registration order (and,
  within one endpoint, in the order its worker exposes them), **then** the primary's own GPUs.
  RPC servers go to the *front* of the list. The primary's CPU is never in the list: it holds the
  layers that are not offloaded.
- ``n_gpu_layers = g`` offloads layers ``i >= n_layer + 1 - g`` and counts the output layer as
  one of the ``g``; the output sits on the last offload device. So with ``k`` layers on the
  primary's CPU, ``g = n_layer + 1 - k`` and ``tensor_split`` holds, per offload device, its layer
  count, plus one on the last device for the output. All remote: ``g = n_layer + 1``. Nothing
  offloaded: ``g = 0`` and ``tensor_split = []``. ``llama_layer_assignment`` (agent/layers.py) replays llama.cpp's
  rule so tests can prove a plan lands where it says.
- Hence ``Plan.devices`` is ordered exactly as the layers run: the primary's CPU (always first,
  possibly with no layers, because it always holds the token embeddings and host buffers), then
  the remote nodes' devices grouped per node, then the primary's GPUs. ``tensor_split`` has one
  entry per device after the first, in that order. The runtime must make llama.cpp see the same
  list: each worker exposes exactly its plan devices in plan order, and the primary limits its
  visible GPUs to the plan's (CUDA_VISIBLE_DEVICES in plan order).
- ggml-rpc moves every activation through the primary (a tensor copy between two different
  servers falls back to get + set on the primary), so each remote node costs one round trip to
  the primary per forward pass, whatever the order of the remote nodes.
- ``Plan.flash_attn`` and ``Plan.n_batch`` size the compute buffers counted here; the runtime
  must pass them to llama.cpp (llama-cpp-python defaults to flash_attn=False, n_batch=512).

Checked for real with llama-cpp-python 0.3.36 and two loopback ggml-rpc workers: the SmolLM2
spread plan (28 layers on the primary's CPU, 1 on the first worker, 1 plus the output on the
second; n_gpu_layers=3, tensor_split=[1, 2]) loaded exactly there, and answered "Paris.".
"""

from __future__ import annotations

from agent.layers import (
    llama_layer_assignment as llama_layer_assignment,  # the one copy of llama.cpp's rule, re-exported
)

from .cost import (
    DEFAULT_COST,
    CostModel,
    compute_buffer_bytes,
    hop_s,
    host_buffer_bytes,
    kv_bytes_per_layer,
    layer_times,
    output_time_s,
)
from .inputs import (
    DEFAULT_LINK,
    LOCAL_LINK,
    ClusterSnapshot,
    DeviceSnapshot,
    GiB,
    Link,
    MiB,
    NodeSnapshot,
    PlacementRequest,
)
from .plan import PlacementRefused, Plan, PlanDevice, fmt_bytes
from .search import plan_placement
from .vllm import VllmModel, choose_engine, plan_vllm

__all__ = [
    "DEFAULT_COST",
    "DEFAULT_LINK",
    "LOCAL_LINK",
    "ClusterSnapshot",
    "CostModel",
    "DeviceSnapshot",
    "GiB",
    "Link",
    "MiB",
    "NodeSnapshot",
    "PlacementRefused",
    "PlacementRequest",
    "Plan",
    "PlanDevice",
    "VllmModel",
    "choose_engine",
    "compute_buffer_bytes",
    "fmt_bytes",
    "hop_s",
    "host_buffer_bytes",
    "kv_bytes_per_layer",
    "layer_times",
    "llama_layer_assignment",
    "output_time_s",
    "plan_placement",
    "plan_vllm",
]
