"""The agent's one retry helper: capped exponential backoff with jitter, built on tenacity.

Every retry in the agent (controller requests, reports, enrollment, Redis, the RPC worker's
restarts) goes through `retry_call`, so they all back off the same way and all stop at once when
the agent is told to stop.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
)
from tenacity.wait import wait_base

ExceptionTypes = type[BaseException] | tuple[type[BaseException], ...]


class RetryStopped(Exception):
    """The stop event was set (or `give_up` said so) while waiting for the next try."""


class JitteredBackoff(wait_base):
    """base * 2**n, capped, times a random factor in [0.5, 1): a fleet never retries in lockstep.

    n is the number of failures so far, plus `offset` (a backoff carried over from earlier).
    """

    def __init__(self, *, base: float, cap: float, offset: int = 0) -> None:
        self.base = base
        self.cap = cap
        self.offset = offset

    def delay(self, failures: int) -> float:
        exponent = max(0, failures)
        # 2.0**exponent overflows a float past 1023; the cap is reached long before.
        raw = self.cap if exponent > 60 else min(self.cap, self.base * 2.0**exponent)
        return raw * (0.5 + random.random() / 2)

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(self.offset + retry_state.attempt_number - 1)


def backoff_delay(attempt: int, *, base: float = 0.5, cap: float = 30.0) -> float:
    """The delay before retry number `attempt` + 1 (attempt 0 is the first retry)."""
    return JitteredBackoff(base=base, cap=cap).delay(attempt)


def retry_call[T](
    fn: Callable[[], T],
    *,
    retry_on: ExceptionTypes,
    base: float,
    cap: float,
    attempts: int | None = None,
    stop: threading.Event | None = None,
    give_up: Callable[[], bool] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    offset: int = 0,
) -> T:
    """Call `fn` until it returns, retrying the `retry_on` errors with capped, jittered backoff.

    attempts: how many calls in all (None: no limit); once spent, the last error is raised.
    stop: waits happen on this event; when it is set the wait ends and RetryStopped is raised,
    with no further call. give_up: checked after each wait, with the same effect.
    on_retry(error, failures, delay): called before each wait (logging, health marks).
    offset: failures carried over from an earlier run, so the backoff goes on growing.
    Any other error is raised at once.
    """

    def wait(delay: float) -> None:
        if stop is not None:
            if stop.wait(delay):
                raise RetryStopped
        else:
            sleep(delay)
        if give_up is not None and give_up():
            raise RetryStopped

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None and state.next_action is not None:
            error = state.outcome.exception()
            if error is not None:
                on_retry(error, state.attempt_number, state.next_action.sleep)

    retrying = Retrying(
        retry=retry_if_exception_type(retry_on),
        stop=stop_after_attempt(attempts) if attempts is not None else stop_never,
        wait=JitteredBackoff(base=base, cap=cap, offset=offset),
        sleep=wait,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(fn)
