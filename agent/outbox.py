"""Reports to the controller, sent in order by one thread, each retried until it is accepted.

A command is acknowledged on its queue only once its report was accepted (the `on_accepted`
callback), so a crash in between re-runs the command rather than losing its result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.client import (
    ControllerClient,
    ControllerError,
    ControllerUnavailable,
    NodeRevoked,
    Unauthorized,
)
from agent.protocol import PublicAddressError, Report, new_id
from agent.retry import RetryStopped, retry_call

log = logging.getLogger("agent")

Refusal = Callable[[Exception], None]


class Outbox:
    """Reports in order, each retried with capped backoff until the controller accepts it.

    on_revoked / on_credential_refused: the controller refused this node; `refused()` then turns
    true and the outbox stops trying (nothing more can be reported).
    """

    def __init__(
        self,
        client: ControllerClient,
        *,
        on_revoked: Refusal,
        on_credential_refused: Refusal,
        refused: Callable[[], bool],
        backoff_cap: float = 30.0,
    ) -> None:
        self.client = client
        self.on_revoked = on_revoked
        self.on_credential_refused = on_credential_refused
        self.refused = refused
        self.backoff_cap = backoff_cap
        self._q: list[tuple[Report, Callable[[], None] | None]] = []
        self._cv = threading.Condition()
        self._busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, report: Report, on_accepted: Callable[[], None] | None = None) -> None:
        with self._cv:
            self._q.append((report, on_accepted))
            self._cv.notify()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(5)

    # --- report shapes ----------------------------------------------------------------------------

    def report(self, kind: str, payload: dict[str, Any]) -> None:
        """A report that answers no command (links, models, job_finished)."""
        self.submit(Report(id=new_id(), kind=kind, command_id=None, payload=payload))

    def event(self, event: str, message: str, data: dict[str, Any] | None = None) -> None:
        level = (
            logging.INFO
            if event.endswith(("STARTED", "LOADED", "UPDATED", "DRAINED"))
            else logging.WARNING
        )
        log.log(level, "%s: %s", event, message)
        self.report("event", {"event": event, "message": message, "data": data or {}})

    def fault(self, message: str, *, fatal: bool) -> None:
        self.report("fault", {"fatal": fatal, "message": message})

    def public_violation(self, exc: PublicAddressError, role: str) -> None:
        self.event("PUBLIC_IP_VIOLATION", str(exc), {"address": exc.address, "role": role})

    # --- the sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                while not self._q and not self._stop.is_set():
                    self._cv.wait(0.5)
                if self._stop.is_set():
                    return
                report, callback = self._q[0]
                self._busy = True
            accepted = self._send(report)
            with self._cv:
                if self._q and self._q[0][0] is report:
                    self._q.pop(0)
                self._busy = False
                self._cv.notify_all()
            if accepted and callback is not None:
                try:
                    callback()
                except Exception:
                    log.exception("after-report callback failed")

    def _send(self, report: Report) -> bool:
        """True once the report needs no more sending (accepted, or finally rejected)."""
        if self._stop.is_set() or self.refused():
            return False
        try:
            retry_call(
                lambda: self.client.report(report, retries=0),
                retry_on=ControllerUnavailable,
                base=0.5,
                cap=self.backoff_cap,
                stop=self._stop,
                give_up=self.refused,
            )
        except NodeRevoked as exc:
            self.on_revoked(exc)
            return False
        except Unauthorized as exc:
            self.on_credential_refused(exc)
            return False
        except ControllerError as exc:
            # A final 4xx: resending cannot help. Count it as handled so its command is
            # acknowledged rather than retried forever.
            log.error("controller rejected %s report: %s", report["kind"], exc)
            return True
        except RetryStopped:
            return False
        return True
