"""The RPC tunnel: only the holder of a deployment's key, from the plan's primary, reaches ggml-rpc."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.tunnel import MAGIC_RPC, TunnelClient, TunnelServer, dial, probe
from tests.agent.conftest import free_port


class Upstream:
    """Stands in for ggml-rpc on 127.0.0.1: records every byte it ever receives, echoes them back."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += data
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def tunnel() -> Iterator[tuple[TunnelServer, Upstream, list[tuple[str, dict[str, Any]]]]]:
    up = Upstream()
    refused: list[tuple[str, dict[str, Any]]] = []
    server = TunnelServer(
        host="127.0.0.1",
        port=free_port(),
        target_port=up.port,
        on_refused=lambda m, d: refused.append((m, d)),
    )
    server.start()
    try:
        yield server, up, refused
    finally:
        server.stop()
        up.close()


def _wait(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_deployments_key_from_its_primary_relays_bytes_both_ways(tunnel: Any) -> None:
    server, up, refused = tunnel
    key = secrets.token_hex(32)
    server.authorize("dep-1", key, "127.0.0.1")
    sock = dial("127.0.0.1", server.port, deployment_id="dep-1", key=bytes.fromhex(key))
    with sock:
        sock.sendall(b"ggml hello")
        assert sock.recv(100) == b"ggml hello"
    assert bytes(up.received) == b"ggml hello" and refused == []


@pytest.mark.parametrize("case", ["no handshake", "wrong key", "other deployment", "other host"])
def test_a_connection_without_the_deployments_key_gets_no_byte_through(
    tunnel: Any, case: str
) -> None:
    server, up, refused = tunnel
    key = secrets.token_hex(32)
    server.authorize("dep-1", key, "10.9.9.9" if case == "other host" else "127.0.0.1")
    if case == "no handshake":
        # A raw ggml-rpc client (or an attacker) speaking straight to the port.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.recv(16)  # the nonce
            s.sendall(b"\x00" * 64 + b"RPC_CMD_HELLO")
            s.settimeout(5)
            try:
                assert s.recv(10) == b""  # closed on us...
            except ConnectionResetError:
                pass  # ...or reset, since it never read what we sent
    else:
        dep = "dep-2" if case == "other deployment" else "dep-1"
        use = secrets.token_hex(32) if case == "wrong key" else key
        with pytest.raises(PermissionError, match="refused"):
            dial("127.0.0.1", server.port, deployment_id=dep, key=bytes.fromhex(use))
    _wait(lambda: refused)
    assert up.connections == 0 and bytes(up.received) == b""
    assert refused and refused[0][1]["peer"] == "127.0.0.1"


def test_a_new_deployments_key_replaces_the_old_one(tunnel: Any) -> None:
    server, up, _ = tunnel
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    server.authorize("dep-old", old, None)
    server.authorize("dep-new", new, None)
    with pytest.raises(PermissionError):
        dial("127.0.0.1", server.port, deployment_id="dep-old", key=bytes.fromhex(old))
    dial("127.0.0.1", server.port, deployment_id="dep-new", key=bytes.fromhex(new)).close()
    assert server.authorized() == ["dep-new"]


def test_the_primarys_tunnel_client_gives_llama_server_a_plain_local_endpoint(tunnel: Any) -> None:
    server, up, _ = tunnel
    key = secrets.token_hex(32)
    server.authorize("dep-1", key, "127.0.0.1")
    client = TunnelClient(
        remote_host="127.0.0.1", remote_port=server.port, deployment_id="dep-1", key_hex=key
    )
    try:
        host, port = client.local_endpoint.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(MAGIC_RPC + b" is just bytes here")
            got = b""
            while len(got) < 23:
                got += s.recv(100)
        assert got == MAGIC_RPC + b" is just bytes here"
    finally:
        client.close()


def test_probe_mode_measures_rtt_and_bandwidth_without_touching_ggml_rpc(tunnel: Any) -> None:
    server, up, _ = tunnel
    out = probe("127.0.0.1", server.port, pings=3, bulk_bytes=1 << 20)
    assert out["rtt_ms"] > 0 and out["bandwidth_mbps"] > 0
    assert up.connections == 0
