"""The RPC tunnel: only a plan's primary reaches a node's ggml-rpc server, over mutual TLS.

ggml-rpc has no authentication and a history of critical CVEs (FACTS.md), so the worker binds it
to 127.0.0.1 and this tunnel listens on the node's private advertise address in front of it. For
each deployment the controller issues a key and a certificate from its own CA
(``TunnelTls``: one leaf, server and client use, with its private key): the workers of the plan
get both in rpc_start (with the primary's address), the primary's agent gets both with the plan
(load_primary). On the primary, a local `TunnelClient` per worker listens on 127.0.0.1 for
llama-server's `--rpc` connections and dials the worker's tunnel.

Handshake:

    server → client   16-byte nonce
    client → server   b"RCN2" | len(deployment_id) (1 byte) | deployment_id
    server → client   b"T" when the deployment is authorized here (else the connection closes)
    both              TLS 1.3, both sides presenting the deployment's certificate; each checks
                      the chain against the controller's CA and that the peer's certificate is
                      exactly the deployment's (another deployment's certificate is refused)
    client → server   HMAC-SHA256(key, nonce | deployment_id)           (inside TLS)
    server → client   b"\\x01" when accepted; then ggml-rpc's bytes, inside TLS both ways

Nothing reaches ggml-rpc before all of it passed; after it, every byte is encrypted and
authenticated by TLS, so a byte changed on the path ends that connection (TLS's record MAC)
instead of reaching ggml-rpc.

Probe mode (link probes between nodes, bounded): b"RCNP" | HMAC-SHA256(probe_key, nonce | b"probe")
under the probed node's probe key (agent/protocol.py probe_key; the controller hands it to the
peers it asks to probe that node). Then ops in the clear (they carry no secret): b"p" is echoed,
b"b" + 4-byte big-endian length is followed by that many bytes and answered b"k" once all have
arrived, b"q" closes. A probe connection carries at most PROBE_MAX_BYTES and lives at most
PROBE_MAX_SECONDS. b"RCNQ" instead of a magic is answered by closing (the primary's reachability
check before a load).

A tunnel holds at most MAX_CONNECTIONS connections at once (handshakes included), PROBE_SLOTS of
them probes; one over the cap is closed at once. Each tunnel runs its connections on one asyncio
loop thread: TLS stays on one thread (OpenSSL objects are not shared between threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import ssl
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("agent.tunnel")

MAGIC_RPC = b"RCN2"
MAGIC_PROBE = b"RCNP"
MAGIC_QUIT = b"RCNQ"
GO_TLS = b"T"
NONCE_BYTES = 16
HANDSHAKE_TIMEOUT = 5.0
PROBE_MAX_BYTES = 256 * 2**20
PROBE_MAX_SECONDS = 30.0
MAX_CONNECTIONS = 32
PROBE_SLOTS = 4
RELAY_CHUNK = 256 * 1024

Refused = Callable[[str, dict[str, Any]], None]
T = TypeVar("T")


def mac(key: bytes, nonce: bytes, deployment_id: str) -> bytes:
    return hmac.new(key, nonce + deployment_id.encode(), hashlib.sha256).digest()


def probe_mac(probe_key: bytes, nonce: bytes) -> bytes:
    return hmac.new(probe_key, nonce + b"probe", hashlib.sha256).digest()


# --- the deployment's certificate -----------------------------------------------------------------


@dataclass(frozen=True)
class TunnelTls:
    """A deployment's tunnel certificate, its key and the controller's CA, all PEM (the wire
    form of rpc_start's ``tunnel_tls`` and load_primary's ``rpc_tunnel_tls``)."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_wire(cls, raw: Any) -> TunnelTls:
        """Raises ValueError naming what is wrong."""
        if not isinstance(raw, dict) or not all(
            isinstance(raw.get(k), str) and "-----BEGIN" in raw[k] for k in ("cert", "key", "ca")
        ):
            raise ValueError("the tunnel's TLS material must be {cert, key, ca} in PEM")
        tls = cls(cert=raw["cert"], key=raw["key"], ca=raw["ca"])
        tls.context(server_side=True)  # refuses a key that does not fit the certificate
        return tls

    def to_wire(self) -> dict[str, str]:
        return {"cert": self.cert, "key": self.key, "ca": self.ca}

    @property
    def fingerprint(self) -> bytes:
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(self.cert)).digest()

    def context(self, *, server_side: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # the peer is pinned to this very certificate instead
        ctx.verify_mode = ssl.CERT_REQUIRED
        if server_side:
            ctx.num_tickets = 0  # no resumption: one full handshake per connection
        try:
            ctx.load_verify_locations(cadata=self.ca)
            # ssl loads a certificate chain only from files: a private directory, gone at once.
            with tempfile.TemporaryDirectory(prefix="racon-tunnel-") as d:
                path = Path(d) / "leaf.pem"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.key + "\n" + self.cert)
                ctx.load_cert_chain(path)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"unusable tunnel certificate or key: {exc}") from None
        return ctx

    def peer_is_ours(self, writer: asyncio.StreamWriter) -> bool:
        obj = writer.get_extra_info("ssl_object")
        der = obj.getpeercert(binary_form=True) if obj is not None else None
        return der is not None and hmac.compare_digest(
            hashlib.sha256(der).digest(), self.fingerprint
        )


# --- one asyncio loop thread per tunnel end -----------------------------------------------------


class _LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def cancel_all() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        with contextlib.suppress(Exception):
            self.call(cancel_all(), timeout=5.0)
        with contextlib.suppress(RuntimeError):  # closed already
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(5.0)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 2.0)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(RELAY_CHUNK):
        writer.write(data)
        await writer.drain()


async def relay(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """Copy bytes both ways until either direction ends or fails (a TLS record that does not
    verify fails it), then close both: a tunnelled ggml-rpc connection is all or nothing."""
    _nodelay(a[1])
    _nodelay(b[1])
    tasks = [asyncio.ensure_future(_pipe(a[0], b[1])), asyncio.ensure_future(_pipe(b[0], a[1]))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                log.warning("RPC tunnel connection broken: %s", t.exception())
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(_close(a[1]), _close(b[1]))


# --- the worker's end ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Grant:
    key: bytes
    peer_host: str | None
    tls: TunnelTls
    server_ctx: ssl.SSLContext


class TunnelServer:
    """Worker side: listens on host:port, forwards authenticated connections to 127.0.0.1:target_port."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        target_port: int,
        on_refused: Refused | None = None,
        probe_key: bytes | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host
        self.port = port
        self.target_port = target_port
        self.on_refused = on_refused
        self.probe_key = probe_key
        self.max_connections = max_connections
        self._grants: dict[str, _Grant] = {}
        self._lock = threading.Lock()
        self._loop: _LoopThread | None = None
        self._server: asyncio.Server | None = None
        self._open = 0
        self._probes = 0
        self._refusals = 0

    # --- keys ---------------------------------------------------------------------------------

    def authorize(
        self, deployment_id: str, key_hex: str, peer_host: str | None, tls: TunnelTls
    ) -> None:
        """Accept this deployment's key and certificate (from peer_host only, when given).
        ggml-rpc serves one primary at a time, so a new deployment replaces every earlier one."""
        key = bytes.fromhex(key_hex)
        if len(key) < 16:
            raise ValueError("tunnel key must be at least 16 bytes")
        grant = _Grant(key, peer_host, tls, tls.context(server_side=True))
        with self._lock:
            self._grants = {deployment_id: grant}

    def revoke(self, deployment_id: str | None = None) -> None:
        with self._lock:
            if deployment_id is None:
                self._grants.clear()
            else:
                self._grants.pop(deployment_id, None)

    def authorized(self) -> list[str]:
        with self._lock:
            return list(self._grants)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Listen; raises OSError when the address cannot be bound."""
        if self._loop is not None:
            return
        loop = _LoopThread(f"tunnel-{self.port}")
        try:
            self._server = loop.call(
                asyncio.start_server(
                    self._handle, self.host, self.port, reuse_address=True, backlog=64
                )
            )
        except BaseException:
            loop.stop()
            raise
        self._loop = loop

    def stop(self) -> None:
        loop, server, self._loop, self._server = self._loop, self._server, None, None
        if loop is None:
            return
        if server is not None:
            with contextlib.suppress(RuntimeError):  # closed already
                loop.loop.call_soon_threadsafe(server.close)
        loop.stop()

    @property
    def running(self) -> bool:
        return self._loop is not None

    # --- connections --------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        if self._open >= self.max_connections:
            self._refuse(peer, f"over the cap of {self.max_connections} connections")
            writer.transport.abort()
            return
        self._open += 1
        try:
            await self._serve(peer, reader, writer)
        finally:
            self._open -= 1

    async def _serve(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                nonce = os.urandom(NONCE_BYTES)
                writer.write(nonce)
                magic = await reader.readexactly(4)
                if magic == MAGIC_QUIT:
                    await _close(writer)
                    return
                if magic == MAGIC_PROBE:
                    proof = await reader.readexactly(32)
                    if self.probe_key is None or not hmac.compare_digest(
                        proof, probe_mac(self.probe_key, nonce)
                    ):
                        raise PermissionError("probe without this node's probe key")
                    if self._probes >= PROBE_SLOTS:
                        raise PermissionError(f"over the cap of {PROBE_SLOTS} probes")
                elif magic == MAGIC_RPC:
                    upstream = await self._rpc_handshake(peer, nonce, reader, writer)
                else:
                    raise PermissionError("not a RACoN tunnel handshake")
        except (PermissionError, ConnectionError, TimeoutError, OSError, UnicodeError) as exc:
            self._refuse(peer, str(exc) or type(exc).__name__)
            writer.transport.abort()
            return
        except asyncio.IncompleteReadError:
            self._refuse(peer, "peer closed during the handshake")
            writer.transport.abort()
            return
        if upstream is None:
            self._probes += 1
            try:
                await self._probe(reader, writer)
            finally:
                self._probes -= 1
            return
        await relay((reader, writer), upstream)

    async def _rpc_handshake(
        self, peer: str, nonce: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        n = (await reader.readexactly(1))[0]
        dep_id = (await reader.readexactly(n)).decode("utf-8")
        with self._lock:
            grant = self._grants.get(dep_id)
        if grant is None:
            raise PermissionError(f"deployment {dep_id!r} is not authorized on this worker")
        if grant.peer_host is not None and peer != grant.peer_host:
            if not _same_host(peer, grant.peer_host):
                raise PermissionError(
                    f"deployment {dep_id!r} is served from {grant.peer_host}, not {peer}"
                )
        writer.write(GO_TLS)
        await writer.drain()
        try:
            await writer.start_tls(grant.server_ctx)
        except ssl.SSLError as exc:
            raise PermissionError(f"TLS handshake failed: {exc.reason or exc}") from None
        if not grant.tls.peer_is_ours(writer):
            raise PermissionError(f"the peer's certificate is not deployment {dep_id!r}'s")
        proof = await reader.readexactly(32)
        if not hmac.compare_digest(proof, mac(grant.key, nonce, dep_id)):
            raise PermissionError(f"wrong key for deployment {dep_id!r}")
        up = await asyncio.open_connection("127.0.0.1", self.target_port)
        writer.write(b"\x01")
        await writer.drain()
        return up

    def _refuse(self, peer: str, reason: str) -> None:
        self._refusals += 1
        log.warning("RPC tunnel refused a connection from %s: %s", peer, reason)
        # Bounded: a scan is not an event storm.
        if self.on_refused is not None and self._refusals <= 20:
            try:
                self.on_refused(
                    f"RPC tunnel refused {peer}: {reason}", {"peer": peer, "reason": reason}
                )
            except Exception:  # reporting must never break the listener
                log.exception("tunnel refusal callback failed")

    @staticmethod
    async def _probe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total = 0
        _nodelay(writer)
        try:
            async with asyncio.timeout(PROBE_MAX_SECONDS):
                while True:
                    op = await reader.read(1)
                    if op in (b"", b"q"):
                        return
                    if op == b"p":
                        writer.write(b"p")
                    elif op == b"b":
                        (n,) = struct.unpack(">I", await reader.readexactly(4))
                        total += n
                        if total > PROBE_MAX_BYTES:
                            return
                        left = n
                        while left:
                            got = await reader.read(min(left, RELAY_CHUNK))
                            if not got:
                                return
                            left -= len(got)
                        writer.write(b"k")
                    else:
                        return
                    await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            return
        finally:
            await _close(writer)


def _same_host(peer: str, allowed: str) -> bool:
    """A primary on this very machine may reach the worker over loopback."""
    return peer in ("127.0.0.1", "::1") and allowed in ("127.0.0.1", "::1", "localhost")


# --- the primary's end --------------------------------------------------------------------------


async def open_tunnel(
    host: str,
    port: int,
    *,
    deployment_id: str,
    key: bytes,
    tls: TunnelTls,
    ctx: ssl.SSLContext | None = None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection through a worker's tunnel, TLS after the handshake (PermissionError when
    the worker refuses it or is not the deployment's)."""
    dep = deployment_id.encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        async with asyncio.timeout(timeout):
            nonce = await reader.readexactly(NONCE_BYTES)
            writer.write(MAGIC_RPC + bytes([len(dep)]) + dep)
            if await reader.read(1) != GO_TLS:
                raise PermissionError(
                    f"the RPC tunnel at {host}:{port} refused deployment {deployment_id}"
                )
            await writer.start_tls(ctx or tls.context(server_side=False))
            if not tls.peer_is_ours(writer):
                raise PermissionError(
                    f"the RPC tunnel at {host}:{port} is not deployment {deployment_id}'s"
                )
            writer.write(mac(key, nonce, deployment_id))
            if await reader.read(1) != b"\x01":
                raise PermissionError(
                    f"the RPC tunnel at {host}:{port} refused deployment {deployment_id}"
                )
    except (ssl.SSLError, asyncio.IncompleteReadError, ConnectionError) as exc:
        writer.transport.abort()
        raise PermissionError(
            f"the RPC tunnel at {host}:{port} refused deployment {deployment_id}: {exc}"
        ) from None
    except BaseException:
        writer.transport.abort()
        raise
    return reader, writer


class TunnelClient:
    """Primary side: 127.0.0.1:<port> for llama-server's --rpc, relayed to a worker's tunnel."""

    def __init__(
        self,
        *,
        remote_host: str,
        remote_port: int,
        deployment_id: str,
        key_hex: str,
        tls: TunnelTls,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.remote = (remote_host, remote_port)
        self.deployment_id = deployment_id
        self.key = bytes.fromhex(key_hex)
        self.tls = tls
        self.max_connections = max_connections
        self.failures: list[str] = []  # the last few dial failures, newest last
        self._ctx = tls.context(server_side=False)
        self._open = 0
        self._loop = _LoopThread(f"tunnel-client-{remote_port}")
        try:
            self._server = self._loop.call(
                asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=64)
            )
        except BaseException:
            self._loop.stop()
            raise
        port = self._server.sockets[0].getsockname()[1]
        self.local_endpoint = f"127.0.0.1:{port}"

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            self._loop.loop.call_soon_threadsafe(self._server.close)
        self._loop.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.max_connections:
            writer.transport.abort()
            return
        self._open += 1
        try:
            try:
                remote = await open_tunnel(
                    *self.remote,
                    deployment_id=self.deployment_id,
                    key=self.key,
                    tls=self.tls,
                    ctx=self._ctx,
                )
            except (OSError, PermissionError, TimeoutError) as exc:
                log.error("RPC tunnel to %s:%s failed: %s", *self.remote, exc)
                self.failures = [*self.failures[-9:], str(exc)]
                writer.transport.abort()
                return
            await relay((reader, writer), remote)
        finally:
            self._open -= 1


# --- link probes over the tunnel's probe mode ---------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during the handshake")
        buf += chunk
    return bytes(buf)


def reachable(host: str, port: int, *, timeout: float = 5.0) -> None:
    """Raise OSError unless a tunnel answers at host:port (it sends its nonce; we say goodbye)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        _recv_exact(sock, NONCE_BYTES)
        sock.sendall(MAGIC_QUIT)


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
    host: str,
    port: int,
    *,
    key: bytes,
    pings: int = 5,
    bulk_bytes: int = 2 * 2**20,
    timeout: float = 5.0,
) -> dict[str, float]:
    """Application-level RTT (median of `pings` echoes) and a timed bulk transfer's Mbit/s,
    with the probed node's probe key."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = _recv_exact(sock, NONCE_BYTES)
        sock.sendall(MAGIC_PROBE + probe_mac(key, nonce))
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
