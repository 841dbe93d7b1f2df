"""The one retry helper (agent/retry.py): bounded tries, capped backoff, a stop that ends waiting."""

from __future__ import annotations

import threading

import pytest

from agent.retry import JitteredBackoff, RetryStopped, backoff_delay, retry_call


class Flaky:
    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return "ok"


def test_a_retried_error_is_tried_again_with_growing_capped_waits() -> None:
    sleeps: list[float] = []
    fn = Flaky(4)
    assert retry_call(fn, retry_on=ConnectionError, base=1.0, cap=3.0, sleep=sleeps.append) == "ok"
    assert fn.calls == 5
    assert len(sleeps) == 4
    assert 0.5 <= sleeps[0] <= 1.0 and all(s <= 3.0 for s in sleeps)


def test_the_last_error_is_raised_once_the_attempts_are_spent() -> None:
    sleeps: list[float] = []
    fn = Flaky(10)
    with pytest.raises(ConnectionError, match="failure 3"):
        retry_call(fn, retry_on=ConnectionError, base=0.1, cap=1, attempts=3, sleep=sleeps.append)
    assert fn.calls == 3 and len(sleeps) == 2


def test_an_error_not_listed_is_raised_at_once() -> None:
    fn = Flaky(1, error=ValueError)
    with pytest.raises(ValueError):
        retry_call(fn, retry_on=ConnectionError, base=0.1, cap=1, sleep=lambda _: None)
    assert fn.calls == 1


def test_a_set_stop_event_ends_the_wait_without_another_try() -> None:
    stop = threading.Event()
    fn = Flaky(10)
    stop.set()
    with pytest.raises(RetryStopped):
        retry_call(fn, retry_on=ConnectionError, base=30.0, cap=30.0, stop=stop)
    assert fn.calls == 1


def test_give_up_after_a_wait_stops_the_retries() -> None:
    fn = Flaky(10)
    with pytest.raises(RetryStopped):
        retry_call(fn, retry_on=ConnectionError, base=0.01, cap=0.01, give_up=lambda: fn.calls >= 2)
    assert fn.calls == 2


def test_on_retry_sees_each_failure_and_its_wait() -> None:
    seen: list[tuple[str, int]] = []
    retry_call(
        Flaky(2),
        retry_on=ConnectionError,
        base=0.1,
        cap=1,
        sleep=lambda _: None,
        on_retry=lambda exc, n, delay: seen.append((str(exc), n)),
    )
    assert seen == [("failure 1", 1), ("failure 2", 2)]


def test_an_offset_carries_the_backoff_over_from_earlier_failures() -> None:
    sleeps: list[float] = []
    retry_call(Flaky(1), retry_on=ConnectionError, base=1, cap=100, offset=3, sleep=sleeps.append)
    assert 4.0 <= sleeps[0] <= 8.0


def test_the_backoff_is_capped_even_after_very_many_failures() -> None:
    assert all(backoff_delay(n, base=1, cap=5) <= 5 for n in range(2000))
    assert JitteredBackoff(base=1, cap=5).delay(30) >= 2.5
