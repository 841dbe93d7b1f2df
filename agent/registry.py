"""The deployments on this node, the jobs running on them, and the node's job counters.

One lock guards all of it: the main thread (run_job, cancel_job), the control worker (load,
unload), the runtimes' callbacks (a job finished, a primary exited) and the heartbeat (telemetry)
all read and write it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agent.protocol import JobFinishedPayload, LoadPrimaryPayload, RunJobPayload
from agent.runtime import PrimaryHandle


class DeploymentState(StrEnum):
    """LOADING → LOADED; a load that fails, or an unload, removes the deployment instead."""

    LOADING = "LOADING"
    LOADED = "LOADED"


@dataclass
class Deployment:
    deployment_id: str
    plan: LoadPrimaryPayload
    state: DeploymentState = DeploymentState.LOADING
    primary: PrimaryHandle | None = None
    loading: PrimaryHandle | None = None  # the handle while load() runs, so shutdown can stop it
    pending: list[RunJobPayload] = field(default_factory=list)  # jobs that arrived while loading
    result: dict[str, Any] = field(default_factory=dict)


class DeploymentRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._deployments: dict[str, Deployment] = {}
        self._jobs: dict[str, str] = {}  # job_id → deployment_id, until job_finished
        self._last_job: dict[str, Any] = {}
        self.counters = {
            "commands_total": 0,
            "jobs_finished_total": 0,
            "completion_tokens_total": 0,
            # Completed jobs whose job_finished report was not needed (agent/finished.py).
            "job_reports_skipped_total": 0,
        }

    # --- deployments ----------------------------------------------------------------------------

    def register(self, plan: LoadPrimaryPayload) -> Deployment | None:
        """Add a LOADING deployment for the plan; return the existing one instead if there is one."""
        dep_id = plan["deployment_id"]
        with self._lock:
            existing = self._deployments.get(dep_id)
            if existing is None:
                self._deployments[dep_id] = Deployment(dep_id, plan)
            return existing

    def get(self, dep_id: str) -> Deployment | None:
        with self._lock:
            return self._deployments.get(dep_id)

    def pop(self, dep_id: str) -> Deployment | None:
        with self._lock:
            return self._deployments.pop(dep_id, None)

    def set_loading(self, dep_id: str, handle: PrimaryHandle) -> None:
        with self._lock:
            dep = self._deployments.get(dep_id)
            if dep is not None:
                dep.loading = handle

    def mark_loaded(
        self, dep_id: str, primary: PrimaryHandle, result: dict[str, Any]
    ) -> list[RunJobPayload] | None:
        """LOADING → LOADED; returns the jobs that waited for it, or None if it was removed."""
        with self._lock:
            dep = self._deployments.get(dep_id)
            if dep is None:
                return None
            dep.primary, dep.state, dep.result = primary, DeploymentState.LOADED, result
            pending, dep.pending = dep.pending, []
            return pending

    def all(self) -> list[Deployment]:
        with self._lock:
            return list(self._deployments.values())

    def telemetry(self) -> dict[str, list[str]]:
        """Loaded and loading deployments and running jobs, read together."""
        with self._lock:
            deps = self._deployments.items()
            return {
                "primaries": [d for d, dep in deps if dep.state == DeploymentState.LOADED],
                "loading": [d for d, dep in deps if dep.state == DeploymentState.LOADING],
                "jobs": list(self._jobs),
            }

    def models_loaded(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {"deployment_id": d, "model": dep.plan.get("model_name", "")}
                for d, dep in self._deployments.items()
                if dep.state == DeploymentState.LOADED
            ]

    # --- jobs -----------------------------------------------------------------------------------

    def add_job(self, job: RunJobPayload) -> tuple[Deployment | None, bool]:
        """Track a job on its deployment: (the deployment or None, whether it waits for the load)."""
        with self._lock:
            dep = self._deployments.get(job["deployment_id"])
            if dep is None:
                return None, False
            self._jobs[job["job_id"]] = dep.deployment_id
            if dep.state == DeploymentState.LOADING:
                dep.pending.append(job)
                return dep, True
            return dep, False

    def withdraw_job(self, job_id: str) -> tuple[Deployment | None, bool]:
        """(the job's deployment, whether the job was still waiting for the load and is removed)."""
        with self._lock:
            dep_id = self._jobs.get(job_id)
            dep = self._deployments.get(dep_id) if dep_id else None
            if dep is None or dep.state != DeploymentState.LOADING:
                return dep, False
            before = len(dep.pending)
            dep.pending = [j for j in dep.pending if j["job_id"] != job_id]
            return dep, len(dep.pending) != before

    def job_finished(self, payload: JobFinishedPayload) -> None:
        with self._lock:
            self._jobs.pop(payload["job_id"], None)
            self._last_job = {
                k: payload.get(k)
                for k in ("job_id", "status", "tokens_per_s", "ttft_ms", "completion_tokens")
            }
            self.counters["jobs_finished_total"] += 1
            self.counters["completion_tokens_total"] += int(payload.get("completion_tokens") or 0)

    def running_jobs(self) -> list[tuple[str, str]]:
        """(job_id, deployment_id) of every job not finished yet."""
        with self._lock:
            return list(self._jobs.items())

    def last_job(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._last_job)

    def count_reports_skipped(self, n: int) -> None:
        with self._lock:
            self.counters["job_reports_skipped_total"] += n

    def count_command(self) -> None:
        with self._lock:
            self.counters["commands_total"] += 1
