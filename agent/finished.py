"""A completed job's job_finished report, sent only when the controller did not record the end.

A job's stream carries its end (the done entry, with the usage), and the controller's follower
records the job from it: it finishes the job, then releases the stream, which takes the key out
of the node's prefix (apps/jobs/retention.py, job_stream_release: once the job is terminal and no
one follows it). The job_finished report is the fallback for when no follower did (the client
went away with the controller that served it, a restart): the controller ignores it for a job
already terminal. Sent for every job, it was a whole HTTP request through the controller per job,
on the cores the engine needs (docs/design/serving.md, "Where the CPU goes end to end").

So a completed job's report waits GRACE_SECONDS, then the node's own stream key is looked at, in
one pipeline for every report due: gone means the controller recorded the end and released the
stream, and the report is dropped; still there (a follower that has not finished, a web page
following the job, no follower at all), or Redis not answering, and the report is sent as before.
A failed or cancelled job's report goes at once (failover and the trust checks read those), and
so does every report still waiting when the agent stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import redis

from agent.protocol import JobFinishedPayload, job_stream_key

log = logging.getLogger("agent")

# Long enough for the follower to read the done entry, finish the job and release the stream on a
# busy controller (milliseconds when idle); short enough that a report that is needed comes soon.
GRACE_SECONDS = 2.0


class FinishedReports:
    """job_finished reports of completed jobs, held for GRACE_SECONDS and sent only if needed.

    ``send``: hands a report to the outbox; ``client``: the node's Redis client (None while not
    connected: the report is sent); ``node_id``: this node's id, whose prefix the streams are in;
    ``on_skipped``: told how many reports were not needed (the agent's metrics count them).
    """

    def __init__(
        self,
        *,
        send: Callable[[JobFinishedPayload], None],
        client: Callable[[], redis.Redis | None],
        node_id: Callable[[], str],
        grace: float = GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        on_skipped: Callable[[int], None] | None = None,
    ) -> None:
        self.send = send
        self.client = client
        self.node_id = node_id
        self.grace = grace
        self.clock = clock
        self.on_skipped = on_skipped
        self.dropped = 0  # reports not needed: the controller had released the stream
        self._due: deque[tuple[float, JobFinishedPayload]] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def submit(self, payload: JobFinishedPayload) -> None:
        if payload.get("status") != "completed":
            self.send(payload)
            return
        with self._cv:
            if self._stopped:
                self.send(payload)
                return
            self._due.append((self.clock() + self.grace, payload))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="finished-reports", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def stop(self) -> None:
        """Send every report still held, without looking (a stopping agent's last word)."""
        with self._cv:
            self._stopped = True
            held = [p for _, p in self._due]
            self._due.clear()
            self._cv.notify()
        for payload in held:
            self.send(payload)
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped:
                    left = self._due[0][0] - self.clock() if self._due else None
                    if left is not None and left <= 0:
                        break
                    self._cv.wait(left)
                if self._stopped:
                    return
                now = self.clock()
                due: list[JobFinishedPayload] = []
                while self._due and self._due[0][0] <= now:
                    due.append(self._due.popleft()[1])
            for payload in self.check(due):
                self.send(payload)

    def check(self, payloads: list[JobFinishedPayload]) -> list[JobFinishedPayload]:
        """The reports still needed: those whose stream is still in the node's prefix (all of
        them when Redis cannot say)."""
        client = self.client()
        if client is None or not payloads:
            return payloads
        node = self.node_id()
        try:
            with client.pipeline(transaction=False) as pipe:
                for p in payloads:
                    pipe.exists(job_stream_key(p["job_id"], node))
                there = pipe.execute()
        except redis.RedisError as exc:
            log.info(
                "cannot look at %d finished jobs' streams (%s); reporting them", len(payloads), exc
            )
            return payloads
        needed = [p for p, n in zip(payloads, there, strict=True) if n]
        skipped = len(payloads) - len(needed)
        self.dropped += skipped
        if skipped and self.on_skipped is not None:
            self.on_skipped(skipped)
        return needed
