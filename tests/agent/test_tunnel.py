"""The RPC tunnel: only the holder of a deployment's key and certificate, from the plan's primary,
reaches ggml-rpc, and every byte after the handshake travels inside TLS."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.protocol import probe_key
from agent.tunnel import (
    MAGIC_RPC,
    NONCE_BYTES,
    TunnelClient,
    TunnelServer,
    TunnelTls,
    probe,
    reachable,
)
from tests.agent.harness import free_port
from tests.support.flipping_relay import FlippingRelay

tls_mod = pytest.importorskip("racon.tls", reason="the controller's CA needs cryptography")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tls_mod.ca_load_or_create(var_dir=tmp_path_factory.mktemp("var"))[0]


def deployment_tls(ca: Any, dep: str) -> TunnelTls:
    """As the controller issues it: one leaf per deployment, server and client use."""
    leaf = tls_mod.issue_leaf(ca, common_name=f"racon-tunnel {dep}", server=True, client=True)
    return TunnelTls(cert=leaf.cert_pem.decode(), key=leaf.key_pem.decode(), ca=ca.pem().decode())


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


NODE_KEY = secrets.token_bytes(32)  # the worker node's command key


@pytest.fixture
def tunnel() -> Iterator[tuple[TunnelServer, Upstream, list[tuple[str, dict[str, Any]]]]]:
    up = Upstream()
    refused: list[tuple[str, dict[str, Any]]] = []
    server = TunnelServer(
        host="127.0.0.1",
        port=free_port(),
        target_port=up.port,
        on_refused=lambda m, d: refused.append((m, d)),
        probe_key=probe_key(NODE_KEY),
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


def _client(server: TunnelServer, dep: str, key: str, tls: TunnelTls) -> TunnelClient:
    return TunnelClient(
        remote_host="127.0.0.1", remote_port=server.port, deployment_id=dep, key_hex=key, tls=tls
    )


def _local(client: TunnelClient) -> socket.socket:
    host, port = client.local_endpoint.split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_deployments_key_and_certificate_from_its_primary_relay_bytes_both_ways(
    tunnel: Any, ca: Any
) -> None:
    server, up, refused = tunnel
    key, tls = secrets.token_hex(32), deployment_tls(ca, "dep-1")
    server.authorize("dep-1", key, "127.0.0.1", tls)
    client = _client(server, "dep-1", key, tls)
    try:
        with _local(client) as s:
            assert _echo(s, MAGIC_RPC + b" ggml hello") == MAGIC_RPC + b" ggml hello"
            big = secrets.token_bytes(3 * 2**20)  # a tensor upload's worth, through TLS records
            assert _echo(s, big) == big
    finally:
        client.close()
    assert bytes(up.received) == MAGIC_RPC + b" ggml hello" + big and refused == []


@pytest.mark.parametrize(
    "case", ["wrong key", "other deployment", "other certificate", "other host"]
)
def test_a_connection_without_the_deployments_key_and_certificate_gets_no_byte_through(
    tunnel: Any, ca: Any, case: str
) -> None:
    server, up, refused = tunnel
    key, tls = secrets.token_hex(32), deployment_tls(ca, "dep-1")
    server.authorize("dep-1", key, "10.9.9.9" if case == "other host" else "127.0.0.1", tls)
    dep = "dep-2" if case == "other deployment" else "dep-1"
    use_key = secrets.token_hex(32) if case == "wrong key" else key
    # Another deployment's certificate from the very same CA is not this deployment's.
    use_tls = deployment_tls(ca, "dep-9") if case == "other certificate" else tls
    client = _client(server, dep, use_key, use_tls)
    try:
        with _local(client) as s:
            s.sendall(b"RPC_CMD_HELLO")
            assert _closed(s)
    finally:
        client.close()
    _wait(lambda: refused)
    assert up.connections == 0 and bytes(up.received) == b""
    assert refused and refused[0][1]["peer"] == "127.0.0.1"
    assert client.failures, "the primary's side says why"


def test_a_raw_client_speaking_ggml_rpc_to_the_port_gets_nothing(tunnel: Any, ca: Any) -> None:
    server, up, refused = tunnel
    server.authorize("dep-1", secrets.token_hex(32), None, deployment_tls(ca, "dep-1"))
    for junk in (b"\x00" * 64 + b"RPC_CMD_HELLO", b"RCN1\x05dep-1" + b"\x00" * 32):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.recv(NONCE_BYTES)
            s.sendall(junk)
            assert _closed(s)
    _wait(lambda: len(refused) >= 2)
    assert up.connections == 0 and bytes(up.received) == b""


def test_a_new_deployments_key_replaces_the_old_one(tunnel: Any, ca: Any) -> None:
    server, up, _ = tunnel
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    old_tls, new_tls = deployment_tls(ca, "dep-old"), deployment_tls(ca, "dep-new")
    server.authorize("dep-old", old, None, old_tls)
    server.authorize("dep-new", new, None, new_tls)
    assert server.authorized() == ["dep-new"]
    gone, fresh = _client(server, "dep-old", old, old_tls), _client(server, "dep-new", new, new_tls)
    try:
        with _local(gone) as s:
            s.sendall(b"x")
            assert _closed(s)
        with _local(fresh) as s:
            assert _echo(s, b"still here") == b"still here"
    finally:
        gone.close()
        fresh.close()


def test_a_byte_flipped_on_the_path_after_the_handshake_breaks_that_connection(
    tunnel: Any, ca: Any
) -> None:
    server, up, _ = tunnel
    key, tls = secrets.token_hex(32), deployment_tls(ca, "dep-1")
    server.authorize("dep-1", key, "127.0.0.1", tls)
    relay = FlippingRelay(("127.0.0.1", server.port))
    client = TunnelClient(
        remote_host="127.0.0.1", remote_port=relay.port, deployment_id="dep-1", key_hex=key,
        tls=tls,
    )  # fmt: skip
    try:
        with _local(client) as s:
            assert _echo(s, b"before the flip") == b"before the flip"
            relay.flip.set()
            s.sendall(b"after the flip: set_tensor to a chosen address")
            assert _closed(s), "the connection must end, not carry a changed byte"
        assert relay.flipped.is_set()
        # ggml-rpc saw the bytes before the flip and nothing after it, changed or not.
        assert bytes(up.received) == b"before the flip"
        with _local(client) as s:  # a fresh connection works again
            assert _echo(s, b"again") == b"again"
    finally:
        client.close()
        relay.close()


def test_connections_over_the_cap_are_closed_at_once(ca: Any) -> None:
    up = Upstream()
    refused: list[tuple[str, dict[str, Any]]] = []
    server = TunnelServer(
        host="127.0.0.1", port=free_port(), target_port=up.port,
        on_refused=lambda m, d: refused.append((m, d)), max_connections=3,
    )  # fmt: skip
    server.start()
    held = []
    try:
        for _ in range(3):  # three idle handshakes hold every slot
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            assert len(s.recv(NONCE_BYTES)) == NONCE_BYTES
            held.append(s)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            assert _closed(extra)
        _wait(lambda: any("cap" in d["reason"] for _, d in refused))
        assert any("over the cap of 3" in d["reason"] for _, d in refused)
    finally:
        for s in held:
            s.close()
        server.stop()
        up.close()


def test_probe_mode_needs_the_nodes_probe_key_and_never_touches_ggml_rpc(tunnel: Any) -> None:
    server, up, refused = tunnel
    out = probe("127.0.0.1", server.port, key=probe_key(NODE_KEY), pings=3, bulk_bytes=1 << 20)
    assert out["rtt_ms"] > 0 and out["bandwidth_mbps"] > 0
    with pytest.raises((ConnectionError, OSError)):
        probe("127.0.0.1", server.port, key=secrets.token_bytes(32), pings=3, bulk_bytes=1 << 20)
    _wait(lambda: refused)
    assert "probe key" in refused[0][1]["reason"]
    reachable("127.0.0.1", server.port)  # the primary's check before a load: no refusal
    time.sleep(0.2)
    assert len(refused) == 1 and up.connections == 0
