"""The agent's relay reader (agent/runtime/stream.EventReader) against a real socket.

Events already received are read together (one stream entry); an event that arrives alone is
returned at once, never held for the window; chunked framing and lines split across chunks and
reads are decoded exactly.
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


def test_a_lone_event_is_returned_at_once_whatever_the_window() -> None:
    def body(conn: socket.socket) -> None:
        for i in range(5):
            conn.sendall(frame(event(i, stop=i == 4) + b"\n\n"))
            time.sleep(0.3)

    with engine(body) as resp:
        reader = EventReader(resp, window=10.0)
        got, waits = [], []
        t0 = time.monotonic()
        while (b := reader.batch()) is not None:
            waits.append(time.monotonic() - t0)
            got.append([e["tokens"][0] for e in b])
            if b[-1].get("stop"):
                break
    assert got == [[0], [1], [2], [3], [4]]
    # Each came as it was written (0.3 s apart), not after the 10 s window.
    assert waits[-1] < 10.0


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
