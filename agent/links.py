"""Link probes to peer RPC workers: application-level RTT and a timed, bounded bulk transfer.

The peer's RPC port is its tunnel (agent/tunnel.py), whose probe mode echoes pings and
acknowledges a bulk transfer without ever touching ggml-rpc, on the very path the RPC traffic
takes. A peer without probe mode (an older agent) falls back to the TCP connect time and the
speed of the local interface that routes to it, reported with how it was obtained.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any

import psutil

from agent.protocol import is_private_address
from agent.tunnel import probe as tunnel_probe

log = logging.getLogger("agent.links")

LOOPBACK_MBPS = 100_000.0  # memory-to-memory; faster than any NIC, slower than a device bus
ASSUMED_MBPS = 1_000.0  # gigabit Ethernet: the common home/office link when the NIC won't say


def _local_address_for(host: str, port: int) -> str | None:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # picks a route; sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_speed_mbps(local_addr: str | None) -> tuple[float, str]:
    if local_addr is None:
        return ASSUMED_MBPS, "assumed"
    if local_addr.startswith("127.") or local_addr == "::1":
        return LOOPBACK_MBPS, "loopback"
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local_addr for a in addrs):
            st = stats.get(name)
            if st and st.speed > 0:
                return float(st.speed), f"nic:{name}"
            return ASSUMED_MBPS, f"assumed:{name}"
    return ASSUMED_MBPS, "assumed"


def tcp_rtt_ms(host: str, port: int, *, samples: int = 5, timeout: float = 2.0) -> float:
    """Median TCP connect time. Raises OSError when the peer cannot be reached at all."""
    times: list[float] = []
    last_error: OSError | None = None
    for _ in range(samples):
        t0 = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout):
                times.append((time.perf_counter() - t0) * 1000)
        except OSError as exc:
            last_error = exc
    if not times:
        raise last_error or OSError(f"{host}:{port} unreachable")
    return round(statistics.median(times), 3)


BULK_BYTES = 2 * 2**20  # long enough to time on a LAN, short enough for every peer each round
BULK_BYTES_MAX = 64 * 2**20  # what a controller may ask for (the tunnel caps a connection too)


def bulk_bytes_for(value: Any) -> int:
    """The bulk transfer's size a probe_links command asked for, bounded."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return BULK_BYTES
    return min(value, BULK_BYTES_MAX)


def probe_peer(
    peer: dict[str, Any], *, samples: int = 5, bulk_bytes: int = BULK_BYTES
) -> dict[str, Any]:
    node_id = str(peer.get("node_id", ""))
    host = str(peer.get("address", ""))
    try:
        port = int(peer.get("rpc_port", 0))
    except (TypeError, ValueError):
        port = 0
    out: dict[str, Any] = {"node_id": node_id, "address": host, "rpc_port": port}
    if not host or not 0 < port < 65536:
        out["error"] = "malformed peer: needs address and rpc_port"
        return out
    if not is_private_address(host):
        out["error"] = f"Public IP security violation: {host} is outside the private ranges"
        out["public"] = True
        return out
    try:
        # The peer's tunnel answers probes only with its probe key (from the controller).
        key = bytes.fromhex(str(peer.get("probe_key") or ""))
        if len(key) < 16:
            raise ConnectionError("the controller gave no probe key for this peer")
        measured = tunnel_probe(host, port, key=key, pings=samples, bulk_bytes=bulk_bytes)
        out.update(measured)
        out["rtt_method"] = "tunnel-echo"
        out["bandwidth_method"] = "measured"
        out["bulk_bytes"] = bulk_bytes
        return out
    except (OSError, ConnectionError, ValueError) as exc:
        # An older agent's port has no probe mode (or the probe broke): say so, then fall back.
        log.info(
            "link probe to %s:%s: tunnel probe failed (%s); using TCP connect time", host, port, exc
        )
        out["probe_error"] = str(exc)[:200]
    try:
        out["rtt_ms"] = tcp_rtt_ms(host, port, samples=samples)
        out["rtt_method"] = "tcp-connect"
    except OSError as exc:
        out["error"] = f"unreachable: {exc}"
        return out
    mbps, method = interface_speed_mbps(_local_address_for(host, port))
    out["bandwidth_mbps"] = mbps
    out["bandwidth_method"] = method
    return out
