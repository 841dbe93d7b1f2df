"""A completed job's job_finished report goes only when the controller has not released its
stream (agent/finished.py); everything else goes at once. Real Redis (database 15)."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agent.finished import FinishedReports
from agent.protocol import JobFinishedPayload, job_stream_key

NODE = "node-finished-test"
GRACE = 0.3


def payload(job_id: str, status: str = "completed") -> JobFinishedPayload:
    return JobFinishedPayload(
        job_id=job_id,
        status=status,  # type: ignore[typeddict-item]
        finish_reason="stop" if status != "failed" else None,
        prompt_tokens=3,
        completion_tokens=2,
        ttft_ms=1.0,
        tokens_per_s=9.0,
        attempt=1,
    )


class Sent:
    def __init__(self) -> None:
        self.rows: list[tuple[float, JobFinishedPayload]] = []
        self.cv = threading.Condition()

    def __call__(self, p: JobFinishedPayload) -> None:
        with self.cv:
            self.rows.append((time.monotonic(), p))
            self.cv.notify_all()

    def ids(self) -> list[str]:
        return [p["job_id"] for _, p in self.rows]

    def wait(self, n: int, timeout: float = 10.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.rows) >= n, timeout), self.ids()


def reports(sent: Sent, client: Any) -> FinishedReports:
    return FinishedReports(send=sent, client=lambda: client, node_id=lambda: NODE, grace=GRACE)


def stream(client: Any, job_id: str) -> str:
    key = job_stream_key(job_id, NODE)
    client.test_keys.append(key)  # deleted after the test (tests/agent/harness.py)
    client.xadd(key, {"seq": "0", "type": "done"})
    client.expire(key, 60)
    return key


def test_a_completed_job_whose_stream_was_released_is_not_reported(
    redis_client: Any, job_id: str
) -> None:
    sent = Sent()
    fr = reports(sent, redis_client)
    key = stream(redis_client, job_id)
    fr.submit(payload(job_id))
    redis_client.delete(key)  # the controller recorded the end and released the stream
    deadline = time.monotonic() + 10
    while fr.dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fr.dropped == 1
    assert sent.rows == []
    fr.stop()
    assert sent.rows == []


def test_a_completed_job_whose_stream_is_still_there_is_reported_after_the_grace(
    redis_client: Any, job_id: str
) -> None:
    sent = Sent()
    fr = reports(sent, redis_client)
    stream(redis_client, job_id)
    t0 = time.monotonic()
    fr.submit(payload(job_id))
    sent.wait(1)
    assert sent.ids() == [job_id]
    assert sent.rows[0][0] - t0 >= GRACE
    assert fr.dropped == 0
    fr.stop()


def test_failed_and_cancelled_jobs_are_reported_at_once(redis_client: Any, job_id: str) -> None:
    sent = Sent()
    fr = reports(sent, redis_client)
    fr.submit(payload(job_id, "failed"))
    fr.submit(payload(job_id + "-c", "cancelled"))
    assert sent.ids() == [job_id, job_id + "-c"]  # on the caller's thread, before submit returns
    fr.stop()


def test_reports_are_sent_when_redis_cannot_say(job_id: str) -> None:
    sent = Sent()
    down = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    fr = reports(sent, down)
    fr.submit(payload(job_id))
    sent.wait(1)
    assert sent.ids() == [job_id]
    fr.stop()
    none = FinishedReports(send=sent, client=lambda: None, node_id=lambda: NODE, grace=GRACE)
    none.submit(payload(job_id + "-x"))
    sent.wait(2)
    none.stop()


def test_stop_sends_what_is_held_without_waiting(redis_client: Any, job_id: str) -> None:
    sent = Sent()
    fr = FinishedReports(send=sent, client=lambda: redis_client, node_id=lambda: NODE, grace=60)
    fr.submit(payload(job_id))
    fr.submit(payload(job_id + "-2"))
    assert sent.rows == []
    fr.stop()
    assert sent.ids() == [job_id, job_id + "-2"]
    fr.submit(payload(job_id + "-3"))  # after stop: at once
    assert sent.ids()[-1] == job_id + "-3"


def test_many_due_together_are_looked_at_in_one_pass(redis_client: Any, job_id: str) -> None:
    sent = Sent()
    fr = reports(sent, redis_client)
    kept = [f"{job_id}-{i}" for i in range(0, 20, 2)]
    for i in range(20):
        jid = f"{job_id}-{i}"
        key = stream(redis_client, jid)
        fr.submit(payload(jid))
        if jid not in kept:
            redis_client.delete(key)
    sent.wait(len(kept))
    deadline = time.monotonic() + 10
    while fr.dropped < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(sent.ids()) == sorted(kept)
    assert fr.dropped == 10
    fr.stop()


def test_skipped_reports_are_counted_for_the_agents_metrics(redis_client: Any, job_id: str) -> None:
    counted: list[int] = []
    fr = FinishedReports(
        send=Sent(), client=lambda: redis_client, node_id=lambda: NODE, grace=GRACE,
        on_skipped=counted.append,
    )  # fmt: skip
    for i in range(3):
        key = stream(redis_client, f"{job_id}-{i}")
        redis_client.delete(key)
        fr.submit(payload(f"{job_id}-{i}"))
    deadline = time.monotonic() + 10
    while sum(counted) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(counted) == 3
    fr.stop()
