"""Wire formats between the controller and node agents.

This module is the single contract. It has no Django import: the controller's serializers are
checked against it by a contract test (tests/api/test_protocol_contract.py).

Transport:
- Agent → controller: HTTPS JSON.
    POST /api/agent/enroll      EnrollRequest → EnrollResponse  (no credential yet; enrollment token)
    POST /api/agent/heartbeat   Heartbeat → HeartbeatResponse   (Authorization: Node <node_id>:<credential>)
    POST /api/agent/reports     Report → ReportResponse         (same auth)
    GET  /api/agent/protocol    → ProtocolInfo                  (no auth: checked before enrolling)
- Controller → agent: the node's own Redis list ``node_queue_key(node_id)`` holding JSON Commands.
  The agent moves each command atomically into ``node_processing_key(node_id)`` (BLMOVE) and removes
  it once the controller has accepted the command's report, so a crash never loses a command.
- Token streaming: the primary appends StreamEntry fields to the Redis stream
  ``job_stream_key(job_id, node_id)`` under its own node prefix. A cancel is the key
  ``job_cancel_key(job_id, node_id)`` being set; the primary checks it between tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import uuid
from dataclasses import dataclass
from typing import Any, Final, Literal, NotRequired, TypedDict

# 2: errors carry a `code` (node_revoked, sha256_mismatch, out_of_memory, primary_died, ...) and
# nothing is classified by its words any more, so a version-1 agent (whose deaths and refusals
# were told apart by their text) is refused.
PROTOCOL_VERSION = 2
# The protocol versions this side speaks. The agent sends PROTOCOL_VERSION at enrollment and the
# controller answers with its own; each refuses a version outside this tuple, naming both (an
# agent from before the field existed speaks 1). Upgrade: `node-agent upgrade`, or the join line.
SUPPORTED_PROTOCOL_VERSIONS: tuple[int, ...] = (2,)
# The agent reads the controller's version here before it sends the token, so a refused version
# never uses the token up; a controller without this endpoint (404) speaks 1.
PROTOCOL_PATH = "/api/agent/protocol"


def controller_protocol_refusal(theirs: int, *, agent_version: str) -> str | None:
    """The agent's refusal of a controller speaking protocol `theirs`, or None if it speaks it."""
    if theirs in SUPPORTED_PROTOCOL_VERSIONS:
        return None
    return (
        f"the controller speaks node protocol {theirs}; this agent ({agent_version}) speaks "
        f"protocol {PROTOCOL_VERSION} (supports {', '.join(map(str, SUPPORTED_PROTOCOL_VERSIONS))}): "
        "install the controller's agent with `node-agent upgrade` or the join line"
    )


# --- Redis keys -------------------------------------------------------------------------------
# Every key a node may touch lives under its own prefix ``racon:n:{node_id}:`` so that its Redis
# ACL user can be given exactly ``~racon:n:{node_id}:*`` (docs/design/serving.md, the key layout).
# Controller-only keys (``racon:node:{id}:meta``, heartbeats, admission) never use that prefix.

NODE_PREFIX = "racon:n:"
STREAM_MAXLEN = 8192  # entries per job stream (a chunk holds one token or more); XADD caps at it


def node_key_pattern(node_id: str) -> str:
    """The ACL key pattern of a node's own keys."""
    return f"{NODE_PREFIX}{node_id}:*"


def node_queue_key(node_id: str) -> str:
    return f"{NODE_PREFIX}{node_id}:commands"


def node_processing_key(node_id: str) -> str:
    return f"{NODE_PREFIX}{node_id}:processing"


def node_seen_key(node_id: str) -> str:
    """Set of command ids already handled (duplicate detection), with a TTL."""
    return f"{NODE_PREFIX}{node_id}:seen"


def job_stream_key(job_id: str, node_id: str) -> str:
    """The token stream of a job attempt run by `node_id` (the primary of its plan)."""
    return f"{NODE_PREFIX}{node_id}:job:{job_id}"


def job_cancel_key(job_id: str, node_id: str) -> str:
    """Set by the controller when the job is cancelled; the node reads it between tokens."""
    return f"{NODE_PREFIX}{node_id}:cancel:{job_id}"


def kv_held_key(node_id: str, deployment_id: str) -> str:
    """What a vLLM primary's KV-cache events say each slot still holds (issue 30): a JSON object
    slot -> tokens cached, written by the node (SET, 1 h). A node's claim: the controller may only
    lower its own prefix record with it (apps/jobs/kvcache.py), never raise it."""
    return f"{NODE_PREFIX}{node_id}:kv:{deployment_id}"


def heartbeat_key(node_id: str) -> str:
    """Hash holding the last heartbeat time (controller clock) and telemetry of a node."""
    return f"racon:hb:{node_id}"


# Queue direction (added by the agent): the controller appends commands with RPUSH and the agent
# takes the oldest with BLMOVE queue → processing LEFT RIGHT, so commands run in the order issued.
QUEUE_PUSH_SIDE = "RIGHT"
QUEUE_POP_SIDE = "LEFT"
# How long the agent remembers a handled command id (duplicate detection). The agent keeps
# node_seen_key as a sorted set (member = command id, score = agent time handled) so old ids can be
# pruned one by one; the key itself also expires after this long without activity.
SEEN_TTL_SECONDS = 24 * 3600

HEARTBEATS_ZSET = "racon:hb:last"  # member node_id, score = controller time of last heartbeat
STREAM_TTL_SECONDS = 3600

# --- Commands (controller → agent) ------------------------------------------------------------

CommandKind = Literal[
    "rpc_start",  # {}
    "rpc_stop",  # {}
    "load_primary",  # LoadPrimaryPayload
    "unload",  # {"deployment_id"}
    "run_job",  # RunJobPayload
    "cancel_job",  # {"job_id"}
    "probe_links",  # {"peers": [{"node_id", "address", "rpc_port"}]}
    "rescan_models",  # {}
    "fetch_model",  # FetchModelPayload
    "hash_challenge",  # {"sha256", "path", "offset", "length", "nonce"} → {"digest"}
    "speed_challenge",  # {"seed", "n", "reps"} → {"digest"} (agent.hardware.benchmark)
    # {"step", "challenge_id", …}: prepare → ready, ping → pong, run {"nonce"} → {"digest"},
    # reveal → {"answer"} (agent.runtime.ggml_matmul)
    "gpu_challenge",
    "kv_save",  # {"deployment_id", "slot", "transfer_id", "upload_url"} → {"sha256", "size", ...}
    "kv_restore",  # {"deployment_id", "slot", "transfer_id", "url", "sha256", "size"} → {"n_restored", ...}
    "set_lending",  # {"lending": LendingPolicy.to_wire()} → {"lending", "saved"} (the owner's, from the UI)
]
COMMAND_KINDS: tuple[str, ...] = (
    "rpc_start",
    "rpc_stop",
    "load_primary",
    "unload",
    "run_job",
    "cancel_job",
    "probe_links",
    "rescan_models",
    "fetch_model",
    "hash_challenge",
    "speed_challenge",
    "gpu_challenge",
    "kv_save",
    "kv_restore",
    "set_lending",
)
# Commands acknowledged without a command_result once accepted: nobody waits on their result, and
# the job's stream and job_finished report carry its outcome. A refusal still sends a result.
SILENT_ON_SUCCESS: frozenset[str] = frozenset({"run_job"})


class Command(TypedDict):
    id: str
    kind: str
    payload: dict[str, Any]
    issued_at: float  # controller clock (time.time()); the agent refuses one older than its max age
    node_id: str  # the node it is addressed to (signed: a copy on another node's queue is refused)
    sig: str  # command_signature(): HMAC-SHA256 under the node's command key, hex


# --- Signed commands (docs/design/serving.md, "The command envelope") ---------------------------
# Every command carries an HMAC under a per-node key the controller issues at enrollment
# (EnrollResponse.command_key; a node enrolled before it asks in a heartbeat). The agent refuses
# an unsigned or wrongly signed command, one addressed to another node, one issued more than its
# --command-max-age ago (or more than the skew ahead), and one whose id it already ran; it says
# so in a command_result with one of these codes.
COMMAND_SIGNATURE_VERSION = "racon-command-v1"
COMMAND_MAX_AGE_SECONDS = 600.0  # the agent's default --command-max-age
COMMAND_CLOCK_SKEW_SECONDS = 60.0  # how far ahead of the agent's clock an issue time may be
COMMAND_REFUSALS: tuple[str, ...] = (
    "command_unsigned",
    "command_bad_signature",
    "command_wrong_node",
    "command_stale",
    "command_replayed",
)


def command_signing_bytes(
    *, node_id: str, command_id: str, kind: str, payload: dict[str, Any], issued_at: float
) -> bytes:
    """The bytes a command's HMAC covers: canonical JSON (sorted keys, no spaces, ASCII), which
    both sides rebuild from the parsed values, so no byte-exact copy of the queue item is needed."""
    body = [COMMAND_SIGNATURE_VERSION, node_id, command_id, kind, issued_at, payload]
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def command_signature(
    key: bytes,
    *,
    node_id: str,
    command_id: str,
    kind: str,
    payload: dict[str, Any],
    issued_at: float,
) -> str:
    msg = command_signing_bytes(
        node_id=node_id, command_id=command_id, kind=kind, payload=payload, issued_at=issued_at
    )
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def probe_key(command_key: bytes) -> bytes:
    """A node's RPC-tunnel probe key: both the node and the controller derive it from the node's
    command key; the controller hands it to the peers it asks to probe that node."""
    return hmac.new(command_key, b"racon-probe-key-v1", hashlib.sha256).digest()


class LoadPrimaryPayload(TypedDict):
    deployment_id: str
    model_name: str
    model_path: NotRequired[str]  # path on the primary; resolved from sha256 when absent
    sha256: str
    rpc_endpoints: list[str]  # "host:port", in plan order
    tensor_split: list[float]  # one entry per device: RPC devices in order, then local last
    # The plan's offload devices by llama.cpp name (RPC1, Vulkan0), one per tensor_split entry:
    # llama-server's --device ("none": CPU only). Absent (an older controller): every device.
    offload_devices: NotRequired[list[str]]
    n_gpu_layers: int
    n_ctx: int
    n_parallel: int
    n_threads: int
    memory_bytes: NotRequired[int]  # predicted memory on the primary; refused when it exceeds RAM
    n_batch: NotRequired[int]  # llama.cpp n_batch the plan's memory estimate assumed
    flash_attn: NotRequired[bool]
    rpc_tunnel_key: NotRequired[str]  # hex; the deployment's key for its workers' RPC tunnels
    # {cert, key, ca} PEM: the deployment's tunnel certificate from the controller's CA, with its
    # key; required with rpc_tunnel_key when the plan has RPC workers (agent/tunnel.py TunnelTls)
    rpc_tunnel_tls: NotRequired[dict[str, str]]
    # The engine (issue 30): "llamacpp" (absent) or "vllm". A vLLM plan names a model directory
    # (model_path) whose sha256 is that of its SHA256SUMS manifest, has no RPC workers, and gives
    # the KV cache kv_bytes.
    engine: NotRequired[str]
    kv_bytes: NotRequired[int]


class RunJobPayload(TypedDict):
    job_id: str
    deployment_id: str
    kind: Literal["chat", "completion"]
    # chat: {role, content} (system, user, assistant, tool); an assistant's may carry OpenAI's
    # tool_calls, a tool result its tool_call_id
    messages: NotRequired[list[dict[str, Any]]]
    prompt: NotRequired[str]
    max_tokens: int
    # The sampling fields: a controller always sends them; the agent fills a missing one from
    # SAMPLING_DEFAULTS (agent.commands.validate_job), so a reader may find them all.
    temperature: NotRequired[float]
    top_p: NotRequired[float]
    stop: list[str]
    seed: NotRequired[int | None]
    presence_penalty: NotRequired[float]
    frequency_penalty: NotRequired[float]
    attempt: NotRequired[int]  # the job attempt (1 first; failover adds one); stamped on entries
    resume_tokens: NotRequired[list[int]]  # failover: token ids an earlier attempt streamed
    # Tools (docs/design/serving.md, "Tool calls, structured output and logprobs"): OpenAI's
    # tool objects, put in the prompt by the model's template (or by the agent when the template
    # knows none); tool_choice and parallel_tool_calls as in OpenAI's request.
    tools: NotRequired[list[dict[str, Any]]]
    tool_choice: NotRequired[str | dict[str, Any]]
    parallel_tool_calls: NotRequired[bool]
    tool_mode: NotRequired[Literal["none", "auto", "forced"]]  # the controller's reading of both
    json_schema: NotRequired[dict[str, Any]]  # the output must match it (a grammar in the engine)
    logprobs: NotRequired[bool]  # chunks carry ``probs``
    top_logprobs: NotRequired[int]  # 0-20 alternatives per token in ``probs``
    # KV cache coordinator (docs/design/serving.md): the llama-server slot to run in, the one
    # holding the conversation's prefix; absent or -1: llama-server picks one
    id_slot: NotRequired[int]
    # Set by the agent when the command arrives (the job's TTFT counts from it); never sent.
    _received_at: NotRequired[float]


class SamplingParams(TypedDict):
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float


# OpenAI's defaults, in one place: the controller fills a request's missing sampling fields from
# here, and the agent fills a run_job's (a job queued by an older controller may lack them).
SAMPLING_DEFAULTS: Final[SamplingParams] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


class FetchModelPayload(TypedDict):
    sha256: str
    file_name: str
    size: int
    url: str  # controller URL serving the file, supports HTTP Range for resume


# --- Reports (agent → controller) -------------------------------------------------------------

ReportKind = Literal[
    "command_result",  # {"ok": bool, "error": str, ...result}
    "event",  # {"event": "RPC_WORKER_STARTED" | ..., "message", "data"}
    "job_finished",  # JobFinishedPayload
    "models",  # {"models": [ModelFileInfo]}
    "links",  # {"links": [LinkProbe]}
    "fault",  # {"fatal": bool, "message"}
]
REPORT_KINDS: tuple[str, ...] = (
    "command_result",
    "event",
    "job_finished",
    "models",
    "links",
    "fault",
)


class Report(TypedDict):
    id: str  # unique per report, for idempotency
    kind: str
    command_id: NotRequired[str | None]
    payload: dict[str, Any]


class JobFinishedPayload(TypedDict):
    job_id: str
    status: Literal["completed", "failed", "cancelled"]
    finish_reason: NotRequired[str | None]  # "stop" | "length" | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: NotRequired[float | None]
    tokens_per_s: NotRequired[float | None]
    error: NotRequired[str]
    # measured compute seconds per plan member, when the runtime can tell
    device_seconds: NotRequired[dict[str, float]]
    attempt: NotRequired[int]  # the job attempt this report is about (1 when absent)


class ModelFileInfo(TypedDict):
    path: str
    file_name: str
    size: int
    mtime: float
    sha256: str


class LinkProbe(TypedDict):
    node_id: str
    rtt_ms: float
    bandwidth_mbps: float


class StreamEntry(TypedDict):
    """Fields of one entry of ``job_stream_key(job_id, node_id)`` (added by the agent). Redis stores strings.

    seq: "0", "1", ... in append order for the job. type: "chunk" (text is generated text),
    "done" (finish_reason is "stop" | "length" | "cancelled"; usage is set) or "error" (text is the
    error message, finish_reason is "error"). usage: JSON of StreamUsage on "done"/"error", else "".
    Exactly one "done" or "error" entry ends every stream.
    """

    seq: str
    type: Literal["chunk", "done", "error"]
    text: str
    finish_reason: NotRequired[str]  # done and error only
    usage: NotRequired[str]  # done and error only
    attempt: NotRequired[str]  # the job attempt this entry belongs to ("1" when absent)
    ids: NotRequired[str]  # chunk: JSON list of the token ids it carries
    n: NotRequired[str]  # chunk: number of tokens (len(ids)); the controller sums these
    code: NotRequired[str]  # error: machine-readable ("context_length_exceeded", "runtime_error")
    # chunk, when the job asked for logprobs: JSON list, one per token of ``ids``, of OpenAI's
    # {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}
    probs: NotRequired[str]
    # chunk of several tokens (coalesced): JSON list of each token's share of ``text`` in
    # characters, so a reader can cut the chunk on a token boundary
    lens: NotRequired[str]


class StreamUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    ttft_ms: float | None
    tokens_per_s: float | None
    id_slot: NotRequired[int]  # the llama-server slot that served it (KV cache coordinator)
    prompt_cached: NotRequired[int]  # prompt tokens taken from the slot's cache, not evaluated
    prompt_evaluated: NotRequired[int]  # prompt tokens the engine evaluated (prefilled)


# --- Enrollment and heartbeats ----------------------------------------------------------------


class GpuInfo(TypedDict):
    index: int
    vendor: str
    name: str
    uuid: str
    vram_total: int
    vram_free: int
    driver: str
    # Measured by agent/hardware/gpu_benchmark.py when the llama.cpp build has a GPU backend;
    # a claim: the controller plans an unverified GPU at a floor (apps/jobs/selectors.py).
    gflops: NotRequired[float]
    mem_bandwidth_gbps: NotRequired[float]
    # llama.cpp's device name (CUDA0, Vulkan0, ROCm0, Metal) and backend (agent/hardware/devices.py):
    # what plans, the layer replay and llama-server's --device use.
    device: NotRequired[str]
    backend: NotRequired[str]
    software: NotRequired[bool]  # a CPU-type device (lavapipe): lent only when named explicitly
    nvml_index: NotRequired[int]  # its NVML entry, for live free memory and utilisation
    pci_bus_id: NotRequired[str]


class Hardware(TypedDict):
    """The hardware inventory an agent sends on enrollment. Sizes are bytes."""

    cpu: dict[str, Any]  # model, physical_cores, logical_cores, flags[]
    memory: dict[str, int]  # total, available
    swap: dict[str, int]  # total, free
    disk: dict[str, Any]  # path, total, free (the models dir)
    network: list[dict[str, Any]]  # name, addresses[]
    gpus: list[GpuInfo]
    benchmark: NotRequired[dict[str, float]]  # gflops, mem_bandwidth_gbps
    fingerprint: NotRequired[str]
    engines: NotRequired[list[str]]  # "llamacpp", "vllm" (issue 30): the engines this node runs


class EnrollRequest(TypedDict):
    token: str
    node_name: str
    machine_id: str
    agent_version: str
    advertise_address: str
    rpc_port: int
    hardware: Hardware
    models: NotRequired[list[ModelFileInfo]]
    protocol_version: NotRequired[int]  # absent: 1
    # The owner's lending terms (agent/lending.py LendingPolicy.to_wire): a claim the controller
    # validates and plans by (windows, caps). Also sent in HARDWARE_UPDATED's data.
    lending: NotRequired[dict[str, Any]]


class EnrollResponse(TypedDict):
    node_id: str
    credential: str
    redis_url: str
    command_key: NotRequired[str]  # hex: the key the node's commands are signed with
    heartbeat_interval: float
    state: str
    protocol_version: NotRequired[int]  # the controller's; absent: 1


class ProtocolInfo(TypedDict):
    protocol_version: int  # the controller's
    supported_protocol_versions: list[int]  # the agent protocols the controller accepts


class Heartbeat(TypedDict):
    state: NotRequired[str]  # what the agent wants: READY once its runtime checks pass
    sent_at: NotRequired[float]  # agent clock; ignored for health decisions
    protocol_version: NotRequired[int]  # the agent's; absent: 1 (refused with 409 if unsupported)
    # An agent enrolled before commands were signed asks once for its command key.
    want_command_key: NotRequired[bool]
    telemetry: dict[
        str, Any
    ]  # cpu_percent, mem_available, gpu_free[], rpc_worker, primaries[], jobs[]


class HeartbeatResponse(TypedDict):
    state: str
    heartbeat_interval: float
    protocol_version: NotRequired[
        int
    ]  # the controller's; absent: 1 (the agent stops if unsupported)
    command_key: NotRequired[str]  # hex, only when the heartbeat asked (want_command_key)


def new_id() -> str:
    return uuid.uuid4().hex


# --- Private-address rule ---------------------------------------------------------------------

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_ULA = ipaddress.ip_network("fc00::/7")


def is_private_address(host: str) -> bool:
    """True for RFC 1918, loopback, link-local, CGNAT 100.64/10 and IPv6 ULA addresses."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if ip.version == 4:
        return bool(
            ip.is_loopback
            or ip.is_link_local
            or ip in _CGNAT
            or any(
                ip in ipaddress.ip_network(n)
                for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
            )
        )
    return bool(ip.is_loopback or ip.is_link_local or ip in _ULA)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port). Raises ValueError on a malformed endpoint."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"malformed endpoint {endpoint!r}: expected host:port")
    p = int(port)
    if not 0 < p < 65536:
        raise ValueError(f"malformed endpoint {endpoint!r}: port out of range")
    return host.strip("[]"), p


@dataclass(frozen=True)
class PublicAddressError(Exception):
    address: str

    def __str__(self) -> str:
        return f"Public IP security violation: {self.address} is outside the private ranges"
