"""The server layer's body limits, header and idle timeouts (issue 28 item 3; racon/daphne_tls.py):
a body is refused by its Content-Length before a byte of it is read, a chunked body as soon as it
passes the limit, headers sent too slowly get 408, and a connection that sends nothing is closed.
Plain daphne does none of it: it reads and spools the whole body before the application sees the
request. The limits are on by default, per route: a few MiB for /v1 and the API, more for the KV
and bundle uploads.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_BODY = 4096
IDLE_SECONDS = 2.0
HEADER_SECONDS = 2.0
MIB = 1024**2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        pass
    return got


def _serve(log: Path, env: dict[str, str]) -> Iterator[int]:
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "racon.daphne_tls", "-b", "127.0.0.1", "-p", str(port)]
            + ["-v", "0", "racon.asgi:application"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"racon.daphne_tls did not listen: {log.read_text()[-2000:]}")
                time.sleep(0.3)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    env = {
        **os.environ,
        "RACON_HTTP_MAX_BODY": str(MAX_BODY),
        "RACON_HTTP_IDLE_TIMEOUT": str(IDLE_SECONDS),
        "RACON_HTTP_HEADER_TIMEOUT": str(HEADER_SECONDS),
    }
    yield from _serve(tmp_path_factory.mktemp("http-limits") / "daphne.log", env)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The server layer as `make run` starts it: no limit set in the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACON_HTTP_")}
    env.pop("KV_TRANSFER_MAX_BYTES", None)
    yield from _serve(tmp_path_factory.mktemp("http-defaults") / "daphne.log", env)


def _post(port: int, path: str, length: int, body: bytes = b"") -> bytes:
    """POST with Content-Length ``length`` and ``body`` sent (may be shorter); the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
            + f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n".encode()
        )
        try:
            sock.sendall(body)
        except OSError:
            pass  # refused and closed while the body was still going
        return _read_all(sock, timeout=60)


def test_a_body_over_the_limit_is_refused_by_its_content_length_before_it_is_sent(
    server: int,
) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        # Headers only: the 100 MB body is never sent. Plain daphne would wait for it.
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        )
        answer = _read_all(sock, timeout=10 * IDLE_SECONDS)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert f"larger than {MAX_BODY} bytes".encode() in answer


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 1024
        try:
            for _ in range(2 * MAX_BODY // len(chunk)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server may close as soon as the limit is passed
        answer = _read_all(sock, timeout=10 * IDLE_SECONDS)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_body_within_the_limit_reaches_the_application(server: int) -> None:
    body = b'{"model": "x", "messages": []}'
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answer = _read_all(sock, timeout=30)
    # No key: the application itself answers (401), not the server layer's 413.
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
        started = time.monotonic()
        sock.settimeout(20 * IDLE_SECONDS)
        try:
            rest = sock.recv(65536)
        except TimeoutError:
            pytest.fail(f"the connection was still open {20 * IDLE_SECONDS:.0f}s later")
        except ConnectionResetError:
            rest = b""
        waited = time.monotonic() - started
    assert not rest.startswith(b"HTTP/1.1 200"), rest[:200]
    assert waited >= IDLE_SECONDS * 0.5  # closed by the timeout, not at once


def test_headers_sent_too_slowly_get_408_though_each_byte_resets_the_idle_timeout(
    server: int,
) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.settimeout(IDLE_SECONDS / 4)
        answer = b""
        deadline = time.monotonic() + 20 * HEADER_SECONDS
        while time.monotonic() < deadline and not answer:
            try:
                sock.sendall(b"a")  # one byte well inside the idle timeout, never the header's end
                answer = sock.recv(65536)
                if not answer:
                    break  # closed without an answer
            except TimeoutError:
                continue
            except OSError:
                break
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_by_default_an_api_body_over_a_few_mib_is_refused_unread(default_server: int) -> None:
    answer = _post(default_server, "/v1/chat/completions", 100 * MIB)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert f"larger than {4 * MIB} bytes".encode() in answer


def test_by_default_the_kv_and_bundle_routes_take_bodies_past_the_api_limit(
    default_server: int,
) -> None:
    body = b"\0" * (8 * MIB)  # twice the API's limit, well within a saved slot's or a bundle's
    for path in ("/api/agent/kv/0123456789abcdef", "/api/admin/bundles"):
        answer = _post(default_server, path, len(body), body)
        # The application's own answer (no node or operator credentials), not the server's 413.
        assert answer.startswith(b"HTTP/1.1 40"), (path, answer[:200])
        assert not answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
    # The KV route has its own limit, one saved slot (KV_TRANSFER_MAX_BYTES, 512 MiB).
    answer = _post(default_server, "/api/agent/kv/0123456789abcdef", 600 * MIB)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_the_launcher_runs_every_daphne_process_with_the_limits() -> None:
    from racon.serve import daphne_argv

    argv = daphne_argv(3)
    assert argv[0].endswith("racon-daphne") or argv[1:3] == ["-m", "racon.daphne_tls"], argv
