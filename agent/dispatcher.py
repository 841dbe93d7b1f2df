"""The main loop: take commands from the node's queue, run each on its thread, report, acknowledge.

A command is acknowledged only once its report was accepted (or, for a run_job that was
accepted, at once: its outcome travels in the job's stream and its job_finished report).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from agent.commands import CONTROL, INLINE, AlreadyLoaded, Commands, Handler
from agent.envelope import CommandGuard, CommandRefused
from agent.models import FetchError
from agent.outbox import Outbox
from agent.protocol import COMMAND_KINDS, SILENT_ON_SUCCESS, PublicAddressError, Report, new_id
from agent.queue import QueueItem
from agent.redis_link import RedisLink
from agent.registry import DeploymentRegistry
from agent.retry import RetryStopped, retry_call
from agent.runtime import RuntimeErrorReport
from agent.runtime.primary import PlanError
from agent.state import CommandError

log = logging.getLogger("agent")


class Dispatcher:
    def __init__(
        self,
        *,
        commands: Commands,
        outbox: Outbox,
        redis_link: RedisLink,
        registry: DeploymentRegistry,
        stop: threading.Event,
        guard: CommandGuard,
    ) -> None:
        self.commands = commands
        self.guard = guard
        self.outbox = outbox
        self.redis_link = redis_link
        self.registry = registry
        self.stop = stop
        self._inflight: set[str] = set()
        self._control = ThreadPoolExecutor(1, thread_name_prefix="control")
        self._io = ThreadPoolExecutor(2, thread_name_prefix="io")

    def run(self) -> None:
        """Until `stop`: a Redis outage is waited out with backoff, a failing command reported."""
        queue = self.redis_link.queue
        assert queue is not None
        while not self.stop.is_set():
            try:
                # The timeout also bounds how long a stop waits.
                item = retry_call(
                    lambda: queue.take(timeout=0.5),
                    retry_on=redis.RedisError,
                    base=0.5,
                    cap=10.0,
                    stop=self.stop,
                    on_retry=self.redis_link.failed,
                )
            except RetryStopped:
                return
            self.redis_link.mark(True)
            if item is None:
                continue
            self.registry.count_command()
            try:
                self.dispatch(item)
            except Exception as exc:  # never let one command take the agent down
                log.exception("command %s failed", item.id)
                self.finish(item, ok=False, error=f"internal error: {type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        self._control.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)

    def dispatch(self, item: QueueItem) -> None:
        if item.command is None:
            log.warning("%s", item.error)
            self.finish(item, ok=False, error=item.error or "malformed command")
            return
        cid = str(item.command["id"])
        queue = self.redis_link.queue
        assert queue is not None
        try:
            self.guard.check(item.command)
        except CommandRefused as exc:
            # Reported, so the controller records who pushed what (a SECURITY event there).
            self.finish(item, ok=False, error=str(exc), code=exc.code)
            return
        item.accepted = True
        if cid in self._inflight or queue.is_duplicate(cid):
            log.info("duplicate command %s (%s) ignored", cid, item.kind)
            self.ack(item)
            return
        kind = item.kind
        if kind not in COMMAND_KINDS:
            self.finish(item, ok=False, error=f"unknown command kind {kind!r}")
            return
        self._inflight.add(cid)
        payload = item.command["payload"]
        handler = self.commands.table[kind]
        if kind == "load_primary":
            try:
                payload = dict(self.commands.register_load(payload))
            except AlreadyLoaded as done:
                self.finish(item, ok=True, already_loaded=True, **done.result)
                return
            except PublicAddressError as exc:
                self.outbox.public_violation(exc, "load_primary")
                self.finish(item, ok=False, error=str(exc))
                return
            except CommandError as exc:
                self.finish(
                    item, ok=False, error=str(exc), **({"code": exc.code} if exc.code else {})
                )
                return
            except PlanError as exc:
                self.finish(item, ok=False, error=str(exc), code=exc.code)
                return
        if kind in INLINE:
            self._run(handler, item, payload)
        elif kind in CONTROL:
            self._control.submit(self._run, handler, item, payload)
        else:
            self._io.submit(self._run, handler, item, payload)

    def _run(self, handler: Handler, item: QueueItem, payload: dict[str, Any]) -> None:
        try:
            result = handler(payload)
        except CommandError as exc:
            self.finish(item, ok=False, error=str(exc), **({"code": exc.code} if exc.code else {}))
        except PublicAddressError as exc:
            self.outbox.public_violation(exc, item.kind)
            self.finish(item, ok=False, error=str(exc))
        except PlanError as exc:
            self.finish(item, ok=False, error=str(exc), code=exc.code)
        except RuntimeErrorReport as exc:
            # An engine that died at its start says so (code engine_failed) with its last lines.
            extra = {k: exc.data[k] for k in ("code", "log_tail", "exit_code") if k in exc.data}
            self.finish(item, ok=False, error=str(exc), **extra)
        except FetchError as exc:
            self.finish(item, ok=False, error=str(exc))
        except Exception as exc:
            log.exception("command %s (%s) failed", item.id, item.kind)
            self.finish(item, ok=False, error=f"internal error: {type(exc).__name__}: {exc}")
        else:
            self.finish(item, ok=True, **(result or {}))

    def finish(self, item: QueueItem, *, ok: bool, error: str | None = None, **result: Any) -> None:
        """Report the command's result; acknowledge it once the controller accepted the report."""
        if ok and item.kind in SILENT_ON_SUCCESS:
            # Skipping the report keeps an HTTP round trip (and a controller write) off the cores
            # while the prompt is evaluated; a crash from here on loses the runtime as well.
            self.ack(item)
            return
        payload: dict[str, Any] = {"ok": ok, "command": item.kind or None, **result}
        if error is not None:
            payload["error"] = error
            log.warning("command %s (%s) failed: %s", item.id, item.kind or "?", error)
        report = Report(id=new_id(), kind="command_result", command_id=item.id, payload=payload)
        self.outbox.submit(report, on_accepted=lambda: self.ack(item))

    def ack(self, item: QueueItem) -> None:
        if item.id and item.accepted:
            self._inflight.discard(item.id)
            self.guard.done(item.command)
        queue = self.redis_link.queue
        if queue is None:
            return
        try:
            queue.ack(item)
        except redis.RedisError as exc:
            # Left in processing: recovered and re-run after a restart (at-least-once).
            log.warning("could not acknowledge command %s: %s", item.id, exc)
