"""The commands a node runs, by name, and what ends a job that never reached a runtime.

Each handler takes the command's payload and returns its result; a refusal is a CommandError
(or a runtime, plan or fetch error), which the dispatcher turns into command_result {ok: false}.
The handlers reach only the parts they need, never the Agent itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable
from urllib.parse import urlsplit

import httpx
import redis

from agent.client import ControllerClient
from agent.config import AgentConfig
from agent.finished import FinishedReports
from agent.hardware import HardwareSource
from agent.hardware.benchmark import speed_challenge_digest
from agent.lending import LendingPolicy, PolicyError, owner_policy_save, policy_from_wire
from agent.links import bulk_bytes_for, probe_peer
from agent.models import (
    MANIFEST,
    OutsideModelsDir,
    ShaCache,
    confined_model_path,
    fetch_model,
    model_dir_digest,
    resolve_model,
    scan_models,
)
from agent.outbox import Outbox
from agent.protocol import (
    SAMPLING_DEFAULTS,
    JobFinishedPayload,
    LoadPrimaryPayload,
    RunJobPayload,
    is_private_address,
    job_cancel_key,
    probe_key,
)
from agent.redis_link import RedisLink
from agent.registry import DeploymentRegistry
from agent.runtime import PrimaryHandle, RpcWorkerHandle, Runtime, RuntimeErrorReport
from agent.runtime.ggml_matmul import GpuChallengeSteps, StepRefused
from agent.runtime.primary import PlanError, check_memory, validate_plan_shape
from agent.runtime.stream import append_done, append_error
from agent.state import CommandError
from agent.tunnel import TunnelTls

log = logging.getLogger("agent")

Handler = Callable[[dict[str, Any]], dict[str, Any]]

# Where each command runs (agent/agent.py has the threads' reasons). Run inline: the quick ones,
# so a job reaches its primary with no extra hop. On the one control worker: the ones that must
# never interleave. Every other command runs on the io workers.
INLINE = frozenset({"run_job", "cancel_job"})
CONTROL = frozenset({"rpc_start", "rpc_stop", "load_primary", "unload"})
RUN_JOB_MAX_TOKENS = 256  # when a run_job carries none
HASH_CHALLENGE_MIN_BYTES = 64 * 1024  # the shortest range a hash_challenge reads
# The GPU challenge's bounds: its answer (m·n bytes) must fit a report, its inputs a small GPU.
GPU_CHALLENGE_MAX_SIDE = 1024
GPU_CHALLENGE_MAX_K = 65536
GPU_CHALLENGE_TIMEOUT_S = 600.0
GPU_DEVICE_NAME = re.compile(r"(CUDA|Vulkan|ROCm|Metal|MTL|SYCL|OpenCL)[0-9]{0,3}")


def rpc_threads(configured: int, lending: LendingPolicy) -> int:
    """The RPC worker's threads: --rpc-threads or every core, never above the owner's thread
    cap (a worker on all cores would lend what the owner kept back)."""
    threads = configured or os.cpu_count() or 1
    cap = lending.caps.threads
    return max(1, min(threads, cap)) if cap else threads


@runtime_checkable
class SlotStateHandle(Protocol):
    """A primary whose slots can be saved and restored (llama-server's; agent/runtime/server.py)."""

    def slot_file(self, filename: str) -> Path: ...

    def slot_save(self, *, slot: int, filename: str, timeout: float = 120.0) -> dict[str, Any]: ...

    def slot_restore(
        self, *, slot: int, filename: str, timeout: float = 120.0
    ) -> dict[str, Any]: ...


KV_TIMEOUT_SECONDS = 120.0


class AlreadyLoaded(Exception):
    """load_primary for a deployment already here with the same plan: its earlier result."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("already loaded")
        self.result = result


class Commands:
    def __init__(
        self,
        *,
        config: AgentConfig,
        registry: DeploymentRegistry,
        runtime: Runtime,
        client: ControllerClient,
        outbox: Outbox,
        hw: HardwareSource,
        sha_cache: ShaCache,
        redis_link: RedisLink,
        node_id: Callable[[], str],
        command_key: Callable[[], bytes | None],
        stop: threading.Event,
        wake_heartbeat: Callable[[], None],
        on_rpc_worker_started: Callable[[], None],
        adopt_lending: Callable[[LendingPolicy], None] | None = None,
    ) -> None:
        self.config = config
        self.adopt_lending = adopt_lending
        # The policy of the --policy file and flags, before any owner's from the UI replaced it.
        self.configured_lending = config.lending
        self.registry = registry
        self.runtime = runtime
        self.client = client
        self.outbox = outbox
        self.hw = hw
        self.sha_cache = sha_cache
        self.redis_link = redis_link
        self.node_id = node_id
        self.command_key = command_key
        self.stop = stop
        self.wake_heartbeat = wake_heartbeat
        self.on_rpc_worker_started = on_rpc_worker_started
        self.log_dir = config.state_dir / "logs"
        self.rpc_worker: RpcWorkerHandle | None = None
        # A completed job's report goes only when the controller did not record its end
        # (agent/finished.py); the rest go to the outbox at once.
        self.finished = FinishedReports(
            send=lambda payload: outbox.report("job_finished", dict(payload)),
            client=lambda: redis_link.client,
            node_id=node_id,
            on_skipped=registry.count_reports_skipped,
        )
        self.gpu_challenges = GpuChallengeSteps(
            max_side=GPU_CHALLENGE_MAX_SIDE,
            max_k=GPU_CHALLENGE_MAX_K,
            device_name=GPU_DEVICE_NAME,
            timeout=GPU_CHALLENGE_TIMEOUT_S,
        )
        self.table: dict[str, Handler] = {
            "rpc_start": self.rpc_start,
            "rpc_stop": self.rpc_stop,
            "load_primary": self.load_primary,
            "unload": self.unload,
            "run_job": self.run_job,
            "cancel_job": self.cancel_job,
            "probe_links": self.probe_links,
            "rescan_models": self.rescan_models,
            "hash_challenge": self.hash_challenge,
            "speed_challenge": self.speed_challenge,
            "gpu_challenge": self.gpu_challenge,
            "fetch_model": self.fetch_model,
            "kv_save": self.kv_save,
            "kv_restore": self.kv_restore,
            "set_lending": self.set_lending,
        }

    # --- the RPC worker ---------------------------------------------------------------------------

    def start_rpc_worker(self) -> dict[str, Any]:
        if self.rpc_worker is None:
            worker = self.runtime.rpc_worker(
                host=self.config.advertise_address,
                port=self.config.rpc_port,
                cache_dir=self.config.state_dir / "rpc-cache",
                n_threads=rpc_threads(self.config.rpc_threads, self.config.lending),
                log_path=self.log_dir / "rpc-worker.log",
                on_event=self.outbox.event,
            )
            key = self.command_key()
            if key is not None:
                worker.allow_probes(probe_key(key))
            self.rpc_worker = worker
        return self.rpc_worker.start()

    def stop_rpc_worker(self) -> None:
        """At shutdown: a worker that will not stop is logged, never raised."""
        if self.rpc_worker is not None:
            try:
                self.rpc_worker.stop(timeout=3.0)
            except Exception:
                log.exception("stopping the RPC worker")

    def rpc_start(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Start (or confirm) the worker and let the plan's primary through its tunnel."""
        dep_id, key, primary = (
            payload.get(k) for k in ("deployment_id", "tunnel_key", "primary_address")
        )
        if key is not None and not (isinstance(dep_id, str) and dep_id and isinstance(key, str)):
            raise CommandError("malformed rpc_start: 'tunnel_key' needs 'deployment_id'")
        tls = None
        if key is not None:
            try:
                tls = TunnelTls.from_wire(payload.get("tunnel_tls"))
            except ValueError as exc:
                raise CommandError(f"malformed rpc_start: 'tunnel_tls': {exc}") from None
        if primary is not None and not (isinstance(primary, str) and is_private_address(primary)):
            raise CommandError(
                f"malformed rpc_start: 'primary_address' {primary!r} is not a private address"
            )
        status = self.start_rpc_worker()
        # With a key, dep_id is a str (checked above); the isinstance narrows it for the checker.
        if key is not None and isinstance(dep_id, str) and tls and self.rpc_worker is not None:
            try:
                self.rpc_worker.authorize(dep_id, key, primary, tls)
            except ValueError as exc:
                raise CommandError(f"malformed rpc_start: {exc}") from None
        self.on_rpc_worker_started()
        return {"rpc_worker": status}

    def rpc_stop(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.rpc_worker is not None:
            self.rpc_worker.stop()
        return {"rpc_worker": {"running": False, "endpoint": self.config.rpc_endpoint}}

    # --- deployments ------------------------------------------------------------------------------

    def register_load(self, payload: dict[str, Any]) -> LoadPrimaryPayload:
        """Check a load_primary and register its deployment at once, so a run_job right behind
        it waits for the load instead of failing. Raises AlreadyLoaded for a repeat."""
        plan = validate_plan_shape(payload)
        existing = self.registry.register(plan)
        if existing is None:
            return plan
        if existing.plan == plan:
            raise AlreadyLoaded(existing.result)
        raise CommandError(
            f"deployment {plan['deployment_id']} is already loaded with another plan; "
            "unload it first"
        )

    def load_primary(self, payload: dict[str, Any]) -> dict[str, Any]:
        plan = cast(LoadPrimaryPayload, payload)  # checked by register_load before it was queued
        dep_id = plan["deployment_id"]
        try:
            if plan.get("engine") == "vllm":
                model = self._resolve_model_dir(plan)
            else:
                model = self._resolve_model(
                    plan["sha256"].lower(), plan.get("model_path"), "load_primary"
                )
            if model is None:
                where = (
                    plan.get("model_path") or f"sha256 {plan['sha256']} in {self.config.models_dir}"
                )
                raise PlanError(f"model file not found: {where}", code="model_missing")
            check_memory(plan, self.hw.memory_total())
            digest = self._dir_digest(model) if model.is_dir() else self.sha_cache.sha256(model)
            if digest != plan["sha256"].lower():
                raise PlanError(
                    f"sha256 mismatch for {model}: the plan expects {plan['sha256'].lower()}, "
                    f"the file has {digest}; refusing to load",
                    code="sha256_mismatch",
                )
            if self.redis_link.client is None:
                raise CommandError("Redis is not connected")
            primary = self.runtime.primary(
                plan=plan,
                node_id=self.node_id(),
                model_path=model,
                redis_client=self.redis_link.client,
                redis_url=self.redis_link.url,
                log_path=self.log_dir / f"primary-{dep_id}.log",
                on_event=self.outbox.event,
                on_job_finished=self.job_finished,
                on_exit=self.primary_exited,
            )
            self.registry.set_loading(dep_id, primary)
            loaded = primary.load()
        except Exception as exc:
            self._fail_deployment(dep_id, str(exc))
            raise
        result = _load_result(dep_id, model, loaded)
        pending = self.registry.mark_loaded(dep_id, primary, result)
        if pending is None:  # unloaded while loading (only via drain): do not leak the process
            primary.stop()
            raise CommandError(f"deployment {dep_id} was unloaded while loading")
        summary = ", ".join(
            f"{a['device']}: {a.get('n_layers', 0)} layers" for a in result["assignment"]
        )
        self.outbox.event(
            "PRIMARY_LOADED",
            f"deployment {dep_id} loaded ({summary})",
            {"deployment_id": dep_id, "assignment": result["assignment"]},
        )
        for job in pending:
            self._submit_job(primary, job)
        self.wake_heartbeat()
        return result

    def _fail_deployment(self, dep_id: str, reason: str) -> None:
        dep = self.registry.pop(dep_id)
        for job in dep.pending if dep else []:
            self.fail_job(job["job_id"], f"deployment {dep_id} failed to load: {reason}")

    def unload(self, payload: dict[str, Any]) -> dict[str, Any]:
        dep_id = payload.get("deployment_id")
        if not isinstance(dep_id, str) or not dep_id:
            raise CommandError("malformed unload: missing 'deployment_id'")
        dep = self.registry.pop(dep_id)
        if dep is None:
            return {"deployment_id": dep_id, "unloaded": False, "reason": "not loaded"}
        for job in dep.pending:
            self.fail_job(job["job_id"], f"deployment {dep_id} was unloaded", cancelled=True)
        if dep.primary is not None:
            dep.primary.stop()
        self.wake_heartbeat()
        return {"deployment_id": dep_id, "unloaded": True}

    def primary_exited(self, deployment_id: str) -> None:
        if self.registry.pop(deployment_id) is not None:
            log.warning("deployment %s is gone; the agent stays up", deployment_id)
        self.wake_heartbeat()

    # --- jobs -------------------------------------------------------------------------------------

    def run_job(self, payload: dict[str, Any]) -> dict[str, Any]:
        job_id = payload.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise CommandError("malformed run_job: missing 'job_id'")
        try:
            job = validate_job(payload)
        except CommandError as exc:
            self.fail_job(job_id, str(exc))
            raise
        job["_received_at"] = time.time()
        dep_id = job["deployment_id"]
        dep, queued = self.registry.add_job(job)
        if queued:
            return {"job_id": job_id, "accepted": True, "queued_behind_load": True}
        if dep is None or dep.primary is None:
            msg = f"deployment {dep_id} is not loaded on this node"
            self.fail_job(
                job_id, msg, code="deployment_not_loaded", attempt=int(job.get("attempt") or 1)
            )
            raise CommandError(msg)
        error = self._submit_job(dep.primary, job)
        if error is not None:
            raise CommandError(error)
        return {"job_id": job_id, "accepted": True}

    def _submit_job(self, primary: PrimaryHandle, job: RunJobPayload) -> str | None:
        """Hand a job to its primary; on failure end the job and return why."""
        try:
            primary.submit(job)
        except RuntimeErrorReport as exc:
            # A primary that died before the agent noticed: the job never ran, and the controller
            # moves it to another replica (primary_died, as for a death mid-job). The attempt
            # number keeps a failover attempt's refusal visible to the reader of that attempt.
            self.fail_job(
                job["job_id"],
                str(exc),
                code="" if primary.alive else "primary_died",
                attempt=int(job.get("attempt") or 1),
            )
            return str(exc)
        return None

    def cancel_job(self, payload: dict[str, Any]) -> dict[str, Any]:
        job_id = payload.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise CommandError("malformed cancel_job: missing 'job_id'")
        r = self.redis_link.client
        if r is not None:
            try:  # the primary also polls this key, which covers a job queued inside the child
                r.set(job_cancel_key(job_id, self.node_id()), "1", ex=3600)
            except redis.RedisError:
                pass
        dep, waiting = self.registry.withdraw_job(job_id)
        if waiting:
            self.fail_job(job_id, "cancelled before its deployment loaded", cancelled=True)
            return {"job_id": job_id, "cancelled": True}
        if dep is not None and dep.primary is not None and dep.primary.cancel(job_id):
            return {"job_id": job_id, "cancelled": True}
        return {"job_id": job_id, "cancelled": False, "reason": "job is not running on this node"}

    def job_finished(self, payload: JobFinishedPayload) -> None:
        self.registry.job_finished(payload)
        log.info(
            "job %s %s (%s tokens%s)",
            payload["job_id"],
            payload["status"],
            payload.get("completion_tokens"),
            f", {payload['error']}" if payload.get("error") else "",
        )
        self.finished.submit(payload)

    def fail_job(
        self, job_id: str, reason: str, *, cancelled: bool = False, code: str = "", attempt: int = 1
    ) -> None:
        """End a job that never reached a runtime: error in its stream, job_finished report.

        ``code`` ``deployment_not_loaded``: the job reached a node whose deployment is gone; the
        controller moves it to another replica (docs/design/serving.md, "Failover")."""
        r = self.redis_link.client
        if r is not None:
            try:
                if cancelled:
                    append_done(
                        r,
                        job_id,
                        "cancelled",
                        {
                            "prompt_tokens": 0,
                            "completion_tokens": 0,
                            "total_tokens": 0,
                            "ttft_ms": None,
                            "tokens_per_s": None,
                        },
                        node_id=self.node_id(),
                    )
                else:
                    append_error(
                        r, job_id, reason, node_id=self.node_id(), code=code, attempt=attempt
                    )
            except redis.RedisError as exc:
                log.error("job %s: cannot write to its stream: %s", job_id, exc)
        self.job_finished(
            JobFinishedPayload(
                job_id=job_id,
                status="cancelled" if cancelled else "failed",
                finish_reason="cancelled" if cancelled else None,
                prompt_tokens=0,
                completion_tokens=0,
                error=reason,
                attempt=attempt,
            )
        )

    # --- models and links -------------------------------------------------------------------------

    def probe_links(self, payload: dict[str, Any]) -> dict[str, Any]:
        peers = payload.get("peers")
        if not isinstance(peers, list):
            raise CommandError("malformed probe_links: 'peers' must be a list")
        bulk = bulk_bytes_for(payload.get("bulk_bytes"))
        links = []
        for peer in peers:
            if not isinstance(peer, dict):
                links.append({"node_id": "", "error": "malformed peer entry"})
                continue
            probe = probe_peer(peer, bulk_bytes=bulk)
            if probe.get("public"):
                self.outbox.event(
                    "PUBLIC_IP_VIOLATION",
                    probe["error"],
                    {"address": probe["address"], "role": "probe_links"},
                )
            links.append(probe)
        self.outbox.report("links", {"links": links})
        return {"links": len(links), "failed": sum(1 for p in links if "error" in p)}

    def rescan_models(self, payload: dict[str, Any]) -> dict[str, Any]:
        models = scan_models(self.config.models_dir, self.sha_cache)
        self.outbox.report("models", {"models": models})
        return {"models": len(models)}

    def hash_challenge(self, payload: dict[str, Any]) -> dict[str, Any]:
        """sha256(nonce | bytes[offset:offset+length]) of this node's copy of a model file: the
        controller compares it with its own copy before it trusts the claim "I hold this file"."""
        try:
            sha, nonce = str(payload["sha256"]).lower(), bytes.fromhex(str(payload["nonce"]))
            offset, length = int(payload["offset"]), int(payload["length"])
        except (KeyError, TypeError, ValueError):
            raise CommandError(
                "malformed hash_challenge: needs sha256, nonce (hex), offset and length"
            ) from None
        if offset < 0 or not 0 < length <= 16 * 2**20:
            raise CommandError("malformed hash_challenge: offset >= 0 and 0 < length <= 16 MiB")
        path = self._resolve_model(sha, payload.get("path"), "hash_challenge")
        if path is None:
            raise CommandError(f"hash_challenge: no file with sha256 {sha} on this node")
        # Only a model file the node offers (its sha is the challenge's), and never a short read:
        # byte-sized ranges would make the challenge an oracle for the file's bytes.
        if self.sha_cache.sha256(path) != sha:
            raise CommandError(
                f"hash_challenge: {path} does not have sha256 {sha}", code="sha256_mismatch"
            )
        size = path.stat().st_size
        if length < min(HASH_CHALLENGE_MIN_BYTES, size) or offset + length > size:
            raise CommandError(
                f"hash_challenge: a range must lie in the file ({size} bytes) and be at least "
                f"{HASH_CHALLENGE_MIN_BYTES} bytes (or the whole file when it is smaller)",
                code="challenge_range",
            )
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        return {"digest": hashlib.sha256(nonce + data).hexdigest(), "path": str(path)}

    def _resolve_model_dir(self, plan: LoadPrimaryPayload) -> Path | None:
        """A vLLM plan's model directory, confined to the models directory like a file."""
        try:
            p = confined_model_path(self.config.models_dir, str(plan.get("model_path") or ""))
        except OutsideModelsDir as exc:
            raise CommandError(
                f"load_primary refused: {exc}", code="path_outside_models_dir"
            ) from None
        if p.is_dir():
            return p
        # Not at the plan's name: the directory in the models dir whose manifest has the plan's
        # sha256 (the full check of every file follows in load_primary).
        sha = plan["sha256"].lower()
        root = self.config.models_dir
        for cand in sorted(root.iterdir()) if root.is_dir() else []:
            manifest = cand / MANIFEST
            try:
                if cand.is_dir() and hashlib.sha256(manifest.read_bytes()).hexdigest() == sha:
                    return cand
            except OSError:
                continue
        return None

    def _dir_digest(self, path: Path) -> str:
        try:
            return model_dir_digest(path, self.sha_cache)
        except ValueError as exc:
            raise PlanError(f"model directory refused: {exc}", code="sha256_mismatch") from None

    def _resolve_model(self, sha: str, model_path: Any, kind: str) -> Path | None:
        if model_path is not None and not isinstance(model_path, str):
            raise CommandError(f"malformed {kind}: the model path must be a string")
        try:
            return resolve_model(
                self.config.models_dir, self.sha_cache, sha256=sha, model_path=model_path
            )
        except OutsideModelsDir as exc:
            raise CommandError(f"{kind} refused: {exc}", code="path_outside_models_dir") from None

    def speed_challenge(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The chain of matmuls the controller times to check this node's gflops claim upward
        (agent.hardware.benchmark.speed_challenge_digest); bounded so a command cannot pin the node."""
        try:
            seed, n, reps = int(payload["seed"]), int(payload["n"]), int(payload["reps"])
        except (KeyError, TypeError, ValueError):
            raise CommandError(
                "malformed speed_challenge: needs integer seed, n and reps"
            ) from None
        if not (0 <= seed < 2**63 and 16 <= n <= 2048 and 1 <= reps <= 10_000):
            raise CommandError(
                "malformed speed_challenge: 0 <= seed < 2^63, 16 <= n <= 2048, 1 <= reps <= 10000"
            )
        return {"digest": speed_challenge_digest(seed=seed, n=n, reps=reps)}

    def gpu_challenge(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One step of the two-phase GPU challenge on one of this node's GPUs (prepare, ping, run,
        reveal: agent/runtime/ggml_matmul.py), run through its own llama.cpp build in a child
        process; the controller times the run and checks the answer (apps/nodes/gpu_challenges.py).
        Bounded so a command cannot pin the node."""
        try:
            return self.gpu_challenges.step(payload)
        except StepRefused as exc:
            raise CommandError(f"gpu_challenge: {exc}") from None

    def fetch_model(self, payload: dict[str, Any]) -> dict[str, Any]:
        for key in ("sha256", "file_name", "url"):
            if not isinstance(payload.get(key), str):
                raise CommandError(f"malformed fetch_model: missing {key!r}")
        size = payload.get("size")
        url = payload["url"]
        if url.startswith("/"):
            url = self.config.controller_url.rstrip("/") + url
        if _origin(url) != _origin(self.config.controller_url):
            raise CommandError(
                f"fetch_model refused: {url!r} is not on the controller's origin "
                f"{_origin(self.config.controller_url)}",
                code="foreign_origin",
            )
        headers = self.client.auth_headers()
        path = fetch_model(
            url=url,
            dest_dir=self.config.models_dir,
            file_name=payload["file_name"],
            sha256=payload["sha256"],
            size=size if isinstance(size, int) else None,
            headers=headers,
            stop=self.stop,
        )
        self.rescan_models({})
        return {"path": str(path), "sha256": payload["sha256"].lower(), "size": path.stat().st_size}

    def set_lending(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The owner set the lending policy in the controller's UI: check it against this
        machine, apply it (the lending monitor reads it from its next evaluation) and keep it
        in the state dir, so it survives a restart (agent/lending.py: owner_policy_at_start)."""
        if self.adopt_lending is None:
            raise CommandError("set_lending: this agent cannot change its lending policy")
        raw = payload.get("lending")
        try:
            if not isinstance(raw, dict):
                raise PolicyError("lending: must be an object")
            policy = policy_from_wire(raw)
            self.adopt_lending(policy)
        except PolicyError as exc:
            self.outbox.event(
                "LENDING_POLICY_REFUSED", f"owner's lending policy refused: {exc}", {}
            )
            raise CommandError(f"set_lending: {exc}") from None
        path = owner_policy_save(self.config.state_dir, policy, configured=self.configured_lending)
        wire = policy.to_wire()
        self.outbox.event("LENDING_POLICY", "adopted the owner's lending policy", {"lending": wire})
        log.info("adopted the owner's lending policy (kept in %s)", path)
        return {"lending": wire, "saved": str(path)}

    # --- KV state transfer (apps/jobs/kvtransfer.py) ---------------------------------------------

    def _slot_handle(self, payload: dict[str, Any], kind: str) -> tuple[SlotStateHandle, int, str]:
        dep_id, slot, tid = (payload.get(k) for k in ("deployment_id", "slot", "transfer_id"))
        if not isinstance(dep_id, str) or not dep_id:
            raise CommandError(f"malformed {kind}: missing 'deployment_id'")
        if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
            raise CommandError(f"malformed {kind}: 'slot' must be a slot index >= 0")
        if not isinstance(tid, str) or not tid.isalnum() or len(tid) > 64:
            raise CommandError(f"malformed {kind}: 'transfer_id' must be 1-64 letters or digits")
        dep = self.registry.get(dep_id)
        if dep is None or dep.primary is None:
            raise CommandError(f"{kind}: deployment {dep_id} is not loaded on this node")
        if not isinstance(dep.primary, SlotStateHandle):
            raise CommandError(f"{kind}: this runtime cannot save or restore slot state")
        return dep.primary, slot, tid

    def _kv_url(self, url: Any, kind: str, field: str) -> str:
        if not isinstance(url, str) or not url.startswith("/api/agent/kv/"):
            raise CommandError(
                f"malformed {kind}: {field!r} must be a controller /api/agent/kv/ path"
            )
        return self.config.controller_url.rstrip("/") + url

    def kv_save(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Save a slot and upload the file to the controller with this node's credential."""
        primary, slot, tid = self._slot_handle(payload, "kv_save")
        url = self._kv_url(payload.get("upload_url"), "kv_save", "upload_url")
        with _staged_slot_file(primary, tid, f"kv_save of slot {slot}") as (filename, path):
            t0 = time.perf_counter()
            saved = primary.slot_save(slot=slot, filename=filename, timeout=KV_TIMEOUT_SECONDS)
            save_s = time.perf_counter() - t0
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
            size = path.stat().st_size
            t1 = time.perf_counter()
            with open(path, "rb") as fh:
                resp = self.client.download().post(
                    url,
                    content=fh,
                    headers={
                        **self.client.auth_headers(),
                        "Content-Type": "application/octet-stream",
                        "Content-Length": str(size),
                    },
                    timeout=httpx.Timeout(KV_TIMEOUT_SECONDS, connect=5.0),
                )
            if resp.status_code != 201:
                raise CommandError(
                    f"kv_save: upload refused ({resp.status_code}): {resp.text[:300]}"
                )
        return {
            "transfer_id": tid,
            "slot": slot,
            "n_saved": int(saved.get("n_saved") or 0),
            "size": size,
            "sha256": digest.hexdigest(),
            "save_s": round(save_s, 4),
            "upload_s": round(time.perf_counter() - t1, 4),
        }

    def kv_restore(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Download a saved slot with this node's credential, check its sha256, restore it."""
        primary, slot, tid = self._slot_handle(payload, "kv_restore")
        url = self._kv_url(payload.get("url"), "kv_restore", "url")
        sha = payload.get("sha256")
        size = payload.get("size")
        if not isinstance(sha, str) or len(sha) != 64:
            raise CommandError("malformed kv_restore: 'sha256' must be 64 hex digits")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise CommandError("malformed kv_restore: 'size' must be a byte count > 0")
        with _staged_slot_file(primary, tid, f"kv_restore into slot {slot}") as (filename, path):
            t0 = time.perf_counter()
            digest = hashlib.sha256()
            got = 0
            with (
                self.client.download().stream(
                    "GET",
                    url,
                    headers=self.client.auth_headers(),
                    timeout=httpx.Timeout(KV_TIMEOUT_SECONDS, connect=5.0),
                ) as resp,
                open(path, "wb") as out,
            ):
                if resp.status_code != 200:
                    resp.read()
                    raise CommandError(
                        f"kv_restore: download refused ({resp.status_code}): {resp.text[:300]}"
                    )
                for chunk in resp.iter_bytes(1 << 20):
                    got += len(chunk)
                    if got > size:
                        raise CommandError(f"kv_restore: more than the {size} bytes announced")
                    digest.update(chunk)
                    out.write(chunk)
            download_s = time.perf_counter() - t0
            if got != size or digest.hexdigest() != sha.lower():
                raise CommandError(
                    f"kv_restore: the download ({got} bytes, sha256 {digest.hexdigest()}) does "
                    f"not match the transfer ({size} bytes, sha256 {sha.lower()}); not restored"
                )
            t1 = time.perf_counter()
            restored = primary.slot_restore(
                slot=slot, filename=filename, timeout=KV_TIMEOUT_SECONDS
            )
        return {
            "transfer_id": tid,
            "slot": slot,
            "n_restored": int(restored.get("n_restored") or 0),
            "size": got,
            "download_s": round(download_s, 4),
            "restore_s": round(time.perf_counter() - t1, 4),
        }


@contextmanager
def _staged_slot_file(
    primary: SlotStateHandle, transfer_id: str, what: str
) -> Iterator[tuple[str, Path]]:
    """The file a kv_save or kv_restore stages a slot's state in: (its name for llama-server, its
    path here). It is removed afterwards whatever happened, and an I/O, HTTP or bad-value error on
    the way becomes a CommandError saying ``what`` failed."""
    filename = f"{transfer_id}.bin"
    path = primary.slot_file(filename)
    try:
        yield filename, path
    except (OSError, httpx.HTTPError, ValueError) as exc:
        raise CommandError(f"{what} failed: {exc}") from None
    finally:
        path.unlink(missing_ok=True)


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in; unparsable: never equal."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return ("?", url, None)
    return (parts.scheme.lower(), (parts.hostname or "").lower(), port)


def _load_result(dep_id: str, model: Path, loaded: dict[str, Any]) -> dict[str, Any]:
    return {
        "deployment_id": dep_id,
        "model_path": str(model),
        "n_layer": loaded.get("n_layer"),
        "n_ctx": loaded.get("n_ctx"),
        "load_ms": loaded.get("load_ms"),
        "warmup_ms": loaded.get("warmup_ms"),
        "assignment": loaded.get("assignment", []),
        "layer_devices": loaded.get("layer_devices", {}),
        "devices": loaded.get("devices", []),
        "load_log": loaded.get("load_log", []),
        "pid": loaded.get("pid"),
        "engine": loaded.get("engine", "llama-server"),
    }


def validate_job(payload: Mapping[str, Any]) -> RunJobPayload:
    """A run_job payload checked, with the defaults filled in (SAMPLING_DEFAULTS for sampling)."""
    job = dict(payload)
    if not isinstance(job.get("deployment_id"), str) or not job["deployment_id"]:
        raise CommandError("malformed run_job: missing 'deployment_id'")
    kind = job.setdefault("kind", "chat")
    if kind == "chat":
        msgs = job.get("messages")
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content", ""), str)
                for m in msgs
            )
        ):
            raise CommandError("malformed run_job: chat needs 'messages' [{role, content}]")
    elif kind == "completion":
        if not isinstance(job.get("prompt"), str):
            raise CommandError("malformed run_job: completion needs a 'prompt' string")
    else:
        raise CommandError(f"malformed run_job: kind must be 'chat' or 'completion', got {kind!r}")
    # object: a TypedDict unpacks as Mapping[str, object]; every value here is a number.
    defaults: dict[str, object] = {"max_tokens": RUN_JOB_MAX_TOKENS, **SAMPLING_DEFAULTS}
    for key, default in defaults.items():
        v = job.setdefault(key, default)
        if v is None:
            job[key] = default
        elif not isinstance(v, int | float) or isinstance(v, bool):
            raise CommandError(f"malformed run_job: {key!r} must be a number")
    stop = job.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise CommandError("malformed run_job: 'stop' must be a list of strings")
    job["stop"] = stop
    _validate_agentic(job)
    return cast(RunJobPayload, job)  # every field it reads was checked above


def _validate_agentic(job: dict[str, Any]) -> None:
    """The tool, structured-output and logprob fields of a run_job (protocol.RunJobPayload)."""
    tools = job.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise CommandError("malformed run_job: 'tools' must be a list of function tools")
    choice = job.get("tool_choice")
    if choice is not None and not (
        choice in ("none", "auto", "required") or isinstance(choice, dict)
    ):
        raise CommandError("malformed run_job: 'tool_choice' must be none, auto, required or {...}")
    if job.get("json_schema") is not None and not isinstance(job["json_schema"], dict):
        raise CommandError("malformed run_job: 'json_schema' must be an object")
    top = job.get("top_logprobs")
    if top is not None and not (
        isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= 20
    ):
        raise CommandError("malformed run_job: 'top_logprobs' must be an integer 0-20")
    slot = job.get("id_slot")
    if slot is not None and not (
        isinstance(slot, int) and not isinstance(slot, bool) and slot >= -1
    ):
        raise CommandError("malformed run_job: 'id_slot' must be an integer slot id (or -1)")
    for m in job.get("messages") or []:
        calls = m.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise CommandError("malformed run_job: a message's 'tool_calls' must be a list")
