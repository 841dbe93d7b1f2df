"""The authenticated RPC tunnel: only a plan's primary reaches a node's ggml-rpc server.

ggml-rpc has no authentication and a history of critical CVEs (FACTS.md), so the worker binds it
to 127.0.0.1 and this tunnel listens on the node's private advertise address in front of it. The
controller issues a key per deployment: the workers of the plan are told to accept it (with the
primary's address), and the primary's agent gets it with the plan. On the primary, a local
`TunnelClient` per worker listens on 127.0.0.1 for llama-server's `--rpc` connections and dials
the worker's tunnel.

Handshake (then plain TCP both ways, no further framing, so the relay is two byte copies):

    server → client   16-byte nonce
    client → server   b"RCN1" | len(deployment_id) (1 byte) | deployment_id | HMAC-SHA256(key, nonce | deployment_id)
    server → client   b"\\x01" when accepted; otherwise the connection is closed and no byte
                      of it ever reaches ggml-rpc

Probe mode (link probes, bounded): the client sends b"RCNP" instead, then ops: b"p" is echoed (an
application-level ping on the RPC path), b"b" + 4-byte big-endian length is followed by that
many bytes and answered b"k" once all have arrived (a timed bulk transfer), b"q" closes. A probe
connection carries at most PROBE_MAX_BYTES and lives at most PROBE_MAX_SECONDS.

There is no encryption: the RPC traffic stays on the private LAN, as before. The key stops other
hosts and other deployments from driving the worker; it does not hide tensors from the LAN.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("agent.tunnel")

MAGIC_RPC = b"RCN1"
MAGIC_PROBE = b"RCNP"
NONCE_BYTES = 16
HANDSHAKE_TIMEOUT = 5.0
PROBE_MAX_BYTES = 256 * 2**20
PROBE_MAX_SECONDS = 30.0
RELAY_BUFFER = 1 << 20

Refused = Callable[[str, dict[str, Any]], None]


def mac(key: bytes, nonce: bytes, deployment_id: str) -> bytes:
    return hmac.new(key, nonce + deployment_id.encode(), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during the handshake")
        buf += chunk
    return bytes(buf)


def _nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


def _pump(src: socket.socket, dst: socket.socket) -> None:
    buf = memoryview(bytearray(RELAY_BUFFER))
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            dst.sendall(buf[:n])
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def relay(a: socket.socket, b: socket.socket, name: str) -> None:
    """Copy bytes both ways until both directions end; closes both sockets."""
    _nodelay(a)
    _nodelay(b)
    t = threading.Thread(target=_pump, args=(b, a), name=f"{name}-back", daemon=True)
    t.start()
    try:
        _pump(a, b)
        t.join()
    finally:
        a.close()
        b.close()


class _Listener:
    def __init__(self, host: str, port: int, name: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.name = name
        self._closed = threading.Event()

    def serve(self, handle: Callable[[socket.socket, Any], None]) -> threading.Thread:
        def loop() -> None:
            while not self._closed.is_set():
                try:
                    conn, addr = self.sock.accept()
                except OSError:
                    return
                threading.Thread(
                    target=handle, args=(conn, addr), name=f"{self.name}-conn", daemon=True
                ).start()

        t = threading.Thread(target=loop, name=self.name, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TunnelServer:
    """Worker side: listens on host:port, forwards authenticated connections to 127.0.0.1:target_port."""

    def __init__(
        self, *, host: str, port: int, target_port: int, on_refused: Refused | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.target_port = target_port
        self.on_refused = on_refused
        self._keys: dict[str, tuple[bytes, str | None]] = {}
        self._lock = threading.Lock()
        self._listener: _Listener | None = None
        self._refusals = 0

    # --- keys ---------------------------------------------------------------------------------

    def authorize(self, deployment_id: str, key_hex: str, peer_host: str | None = None) -> None:
        """Accept this deployment's key (from peer_host only, when given). ggml-rpc serves one
        primary at a time, so a new deployment's key replaces every earlier one."""
        key = bytes.fromhex(key_hex)
        if len(key) < 16:
            raise ValueError("tunnel key must be at least 16 bytes")
        with self._lock:
            self._keys = {deployment_id: (key, peer_host)}

    def revoke(self, deployment_id: str | None = None) -> None:
        with self._lock:
            if deployment_id is None:
                self._keys.clear()
            else:
                self._keys.pop(deployment_id, None)

    def authorized(self) -> list[str]:
        with self._lock:
            return list(self._keys)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._listener is None:
            self._listener = _Listener(self.host, self.port, f"tunnel-{self.port}")
            self._listener.serve(self._handle)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    @property
    def running(self) -> bool:
        return self._listener is not None

    # --- connections --------------------------------------------------------------------------

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        peer = str(addr[0]) if addr else "?"
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(nonce)
            magic = _recv_exact(conn, 4)
            if magic == MAGIC_PROBE:
                self._probe(conn)
                return
            if magic != MAGIC_RPC:
                raise PermissionError("not a RACoN tunnel handshake")
            n = _recv_exact(conn, 1)[0]
            dep_id = _recv_exact(conn, n).decode("utf-8", errors="replace")
            proof = _recv_exact(conn, 32)
            with self._lock:
                entry = self._keys.get(dep_id)
            if entry is None:
                raise PermissionError(f"deployment {dep_id!r} is not authorized on this worker")
            key, allowed = entry
            if not hmac.compare_digest(proof, mac(key, nonce, dep_id)):
                raise PermissionError(f"wrong key for deployment {dep_id!r}")
            if allowed is not None and peer != allowed and not _same_host(peer, allowed):
                raise PermissionError(f"deployment {dep_id!r} is served from {allowed}, not {peer}")
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            upstream.settimeout(None)
            conn.settimeout(None)
            conn.sendall(b"\x01")
        except (PermissionError, ConnectionError, TimeoutError, OSError, UnicodeError) as exc:
            self._refuse(peer, str(exc))
            conn.close()
            return
        relay(conn, upstream, f"tunnel-{dep_id[:8]}")

    def _refuse(self, peer: str, reason: str) -> None:
        self._refusals += 1
        log.warning("RPC tunnel refused a connection from %s: %s", peer, reason)
        if (
            self.on_refused is not None and self._refusals <= 20
        ):  # bounded: a scan is not an event storm
            try:
                self.on_refused(
                    f"RPC tunnel refused {peer}: {reason}", {"peer": peer, "reason": reason}
                )
            except Exception:  # noqa: BLE001 - reporting must never break the listener
                log.exception("tunnel refusal callback failed")

    @staticmethod
    def _probe(conn: socket.socket) -> None:
        deadline = time.monotonic() + PROBE_MAX_SECONDS
        total = 0
        buf = bytearray(RELAY_BUFFER)
        _nodelay(conn)
        try:
            while time.monotonic() < deadline:
                op = conn.recv(1)
                if op in (b"", b"q"):
                    return
                if op == b"p":
                    conn.sendall(b"p")
                elif op == b"b":
                    (n,) = struct.unpack(">I", _recv_exact(conn, 4))
                    total += n
                    if total > PROBE_MAX_BYTES:
                        return
                    left = n
                    while left:
                        got = conn.recv_into(buf, min(left, len(buf)))
                        if not got:
                            return
                        left -= got
                    conn.sendall(b"k")
                else:
                    return
        except OSError:
            return
        finally:
            conn.close()


def _same_host(peer: str, allowed: str) -> bool:
    """A primary on this very machine may reach the worker over loopback."""
    return peer in ("127.0.0.1", "::1") and allowed in ("127.0.0.1", "::1", "localhost")


class TunnelClient:
    """Primary side: 127.0.0.1:<port> for llama-server's --rpc, relayed to a worker's tunnel."""

    def __init__(
        self, *, remote_host: str, remote_port: int, deployment_id: str, key_hex: str
    ) -> None:
        self.remote = (remote_host, remote_port)
        self.deployment_id = deployment_id
        self.key = bytes.fromhex(key_hex)
        self._listener = _Listener("127.0.0.1", 0, f"tunnel-client-{remote_port}")
        self.local_endpoint = f"127.0.0.1:{self._listener.port}"
        self._listener.serve(self._handle)

    def close(self) -> None:
        self._listener.close()

    def _handle(self, local: socket.socket, addr: Any) -> None:
        try:
            remote = dial(
                self.remote[0], self.remote[1], deployment_id=self.deployment_id, key=self.key
            )
        except (OSError, PermissionError) as exc:
            log.error("RPC tunnel to %s:%s failed: %s", self.remote[0], self.remote[1], exc)
            local.close()
            return
        relay(local, remote, f"tunnel-client-{self.deployment_id[:8]}")


def dial(
    host: str, port: int, *, deployment_id: str, key: bytes, timeout: float = HANDSHAKE_TIMEOUT
) -> socket.socket:
    """An authenticated connection through a worker's tunnel (raises PermissionError when refused)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        nonce = _recv_exact(sock, NONCE_BYTES)
        dep = deployment_id.encode()
        sock.sendall(MAGIC_RPC + bytes([len(dep)]) + dep + mac(key, nonce, deployment_id))
        try:
            ok = sock.recv(1)
        except OSError:
            ok = b""
        if ok != b"\x01":
            raise PermissionError(
                f"the RPC tunnel at {host}:{port} refused deployment {deployment_id}"
            )
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


# --- link probes over the tunnel's probe mode ---------------------------------------------------


def reachable(host: str, port: int, *, timeout: float = 5.0) -> None:
    """Raise OSError unless a tunnel answers at host:port (a probe that closes at once)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        _recv_exact(sock, NONCE_BYTES)
        sock.sendall(MAGIC_PROBE + b"q")


PROBE_BULK_SECONDS = 1.0


def _timed_bulk(sock: socket.socket, size: int, *, rtt_ms: float, timeout: float) -> float:
    """Seconds one acknowledged bulk transfer of ``size`` bytes took, less the ack's round trip."""
    sock.settimeout(timeout)
    t0 = time.perf_counter()
    sock.sendall(b"b" + struct.pack(">I", size) + b"\0" * size)
    if _recv_exact(sock, 1) != b"k":
        raise ConnectionError("bulk transfer not acknowledged")
    return max(time.perf_counter() - t0 - rtt_ms / 1000, 1e-6)


def probe(
    host: str, port: int, *, pings: int = 5, bulk_bytes: int = 2 * 2**20, timeout: float = 5.0
) -> dict[str, float]:
    """Application-level RTT (median of `pings` echoes) and a timed bulk transfer's Mbit/s."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _nodelay(sock)
        _recv_exact(sock, NONCE_BYTES)
        sock.sendall(MAGIC_PROBE)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(b"p")
            if _recv_exact(sock, 1) != b"p":
                raise ConnectionError("probe echo mismatch")
            rtts.append((time.perf_counter() - t0) * 1000)
        rtt = statistics.median(rtts)
        # Sized to the link: a small transfer first, then one of about PROBE_BULK_SECONDS at the
        # rate it showed (at most bulk_bytes), so a slow link is measured, not timed out.
        limit = min(bulk_bytes, PROBE_MAX_BYTES // 2)
        first = min(64 * 1024, limit)
        seconds = _timed_bulk(sock, first, rtt_ms=rtt, timeout=timeout)
        rate = first / seconds  # bytes per second
        size = max(first, min(limit, int(rate * PROBE_BULK_SECONDS)))
        if size > first:
            seconds = _timed_bulk(sock, size, rtt_ms=rtt, timeout=timeout + 4 * size / rate)
        sock.sendall(b"q")
        return {
            "rtt_ms": round(rtt, 3),
            "bandwidth_mbps": round(size * 8 / seconds / 1e6, 1),
        }
    finally:
        sock.close()
