"""The agent's relay reader (agent/runtime/stream.EventReader) against a real socket.

Events already received are read together (one stream entry); a slow stream's event is returned
at once, never held for the window, and a fast stream's are gathered for at most the window;
chunked framing and lines split across chunks and reads are decoded exactly.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from agent.runtime.stream import EventReader


def event(i: int, stop: bool = False) -> bytes:
    return b"data: " + json.dumps({"content": f" w{i}", "tokens": [i], "stop": stop}).encode()


def frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


@contextmanager
def engine(body: Callable[[socket.socket], None]) -> Iterator[http.client.HTTPResponse]:
    """A one-shot HTTP server that answers with chunked SSE written by ``body``."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            body(conn)
            conn.sendall(b"0\r\n\r\n")
            time.sleep(0.5)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        client.request("POST", "/completion", b"{}")
        yield client.getresponse()
    finally:
        client.close()
        srv.close()
        t.join(5)


def batches(resp: http.client.HTTPResponse, window: float = 0.02) -> list[list[int]]:
    reader = EventReader(resp, window=window)
    out: list[list[int]] = []
    while (got := reader.batch()) is not None:
        out.append([e["tokens"][0] for e in got])
        if got[-1].get("stop"):
            break
    return out


def test_events_already_received_come_as_one_batch() -> None:
    def body(conn: socket.socket) -> None:
        conn.sendall(b"".join(frame(event(i, stop=i == 49) + b"\n\n") for i in range(50)))

    with engine(body) as resp:
        got = batches(resp, window=1.0)
    assert [t for b in got for t in b] == list(range(50))
    assert len(got) <= 2  # one recv, or two when the kernel split the write


def _timed(resp: http.client.HTTPResponse, window: float) -> tuple[list[list[int]], list[float]]:
    """Each batch's tokens, and when it was handed on (seconds after the first)."""
    reader = EventReader(resp, window=window)
    got: list[list[int]] = []
    at: list[float] = []
    while (b := reader.batch()) is not None:
        at.append(time.monotonic())
        got.append([e["tokens"][0] for e in b])
        if b[-1].get("stop"):
            break
    return got, [t - at[0] for t in at]


def test_a_slow_streams_events_are_returned_at_once() -> None:
    def body(conn: socket.socket) -> None:
        for i in range(5):
            conn.sendall(frame(event(i, stop=i == 4) + b"\n\n"))
            time.sleep(0.4)

    with engine(body) as resp:
        got, at = _timed(resp, window=0.3)  # one event per 0.4 s: slower than one per window
    assert got == [[0], [1], [2], [3], [4]]
    # Each came as it was written (0.4 s apart), not held for the window after it.
    assert at[-1] < 4 * 0.4 + 0.25, at


def test_a_fast_streams_events_travel_together_each_held_at_most_the_window() -> None:
    sent: list[float] = []

    def body(conn: socket.socket) -> None:
        for i in range(60):
            sent.append(time.monotonic())
            conn.sendall(frame(event(i, stop=i == 59) + b"\n\n"))
            time.sleep(0.01)

    with engine(body) as resp:
        reader = EventReader(resp, window=0.1)  # ten events a window
        got: list[list[int]] = []
        late: list[float] = []  # how long each batch's first event was held
        while (b := reader.batch()) is not None:
            now = time.monotonic()
            got.append([e["tokens"][0] for e in b])
            late.append(now - sent[got[-1][0]])
            if b[-1].get("stop"):
                break
    assert [t for b in got for t in b] == list(range(60))
    assert got[0] == [0]  # the first token is never held
    assert len(got) < 30, got  # gathered: far fewer batches than events
    assert max(late) < 0.1 + 0.25, late  # the window, and a busy machine's slack


def test_lines_split_across_chunks_and_reads_are_joined() -> None:
    def body(conn: socket.socket) -> None:
        data = b"".join(event(i, stop=i == 2) + b"\n\n" for i in range(3))
        # Odd chunk sizes, each chunk written on its own with a pause: every boundary is cut.
        for k in range(0, len(data), 7):
            conn.sendall(frame(data[k : k + 7]))
            time.sleep(0.005)

    with engine(body) as resp:
        got = batches(resp)
    assert [t for b in got for t in b] == [0, 1, 2]


def test_a_callable_window_is_asked_at_each_batch() -> None:
    """The primary's window (longer while it is busy) is asked per batch: the same stream at 25
    events a second goes one event a batch with a 0.01 s window, and together once it is 0.2 s."""
    asked: list[float] = []
    current = [0.01]

    def window() -> float:
        asked.append(current[0])
        return current[0]

    def body(conn: socket.socket) -> None:
        for i in range(40):
            if i == 15:
                current[0] = 0.2  # the primary got busy
            conn.sendall(frame(event(i, stop=i == 39) + b"\n\n"))
            time.sleep(0.04)

    with engine(body) as resp:
        reader = EventReader(resp, window=window)
        got: list[list[int]] = []
        while (b := reader.batch()) is not None:
            got.append([e["tokens"][0] for e in b])
            if b[-1].get("stop"):
                break
    assert [t for b in got for t in b] == list(range(40))
    assert len(asked) == len(got)  # once a batch
    early = [b for b in got if b[-1] < 14]
    late = [b for b in got if b[0] > 20]
    assert all(len(b) == 1 for b in early), got  # 0.04 s apart: slower than one per 0.01 s
    assert max(len(b) for b in late) >= 3, got  # 0.04 s apart: several per 0.2 s


def test_the_primary_uses_the_busy_window_from_its_busy_streams_count() -> None:
    from types import SimpleNamespace

    from agent.runtime.server import ServerPrimary
    from agent.runtime.stream import (
        STREAM_COALESCE_BUSY_SECONDS,
        STREAM_COALESCE_BUSY_STREAMS,
        STREAM_COALESCE_SECONDS,
    )

    def window(n: int) -> float:
        fake = SimpleNamespace(_jobs={str(i): object() for i in range(n)})
        return ServerPrimary._coalesce_window(fake)  # type: ignore[arg-type]

    assert window(1) == STREAM_COALESCE_SECONDS
    assert window(STREAM_COALESCE_BUSY_STREAMS - 1) == STREAM_COALESCE_SECONDS
    assert window(STREAM_COALESCE_BUSY_STREAMS) == STREAM_COALESCE_BUSY_SECONDS
    assert STREAM_COALESCE_BUSY_SECONDS > STREAM_COALESCE_SECONDS
