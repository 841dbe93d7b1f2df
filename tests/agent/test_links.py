from __future__ import annotations

import socket

from agent.links import LOOPBACK_MBPS, probe_peer


def test_probe_measures_rtt_to_a_listening_peer() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        port = srv.getsockname()[1]
        probe = probe_peer({"node_id": "peer", "address": "127.0.0.1", "rpc_port": port}, samples=3)
    finally:
        srv.close()
    assert "error" not in probe
    assert 0 < probe["rtt_ms"] < 1000
    assert probe["bandwidth_mbps"] == LOOPBACK_MBPS and probe["bandwidth_method"] == "loopback"


def test_probe_reports_unreachable_and_refuses_public_addresses() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens
    down = probe_peer({"node_id": "p", "address": "127.0.0.1", "rpc_port": port}, samples=1)
    assert down["error"].startswith("unreachable")
    public = probe_peer({"node_id": "p", "address": "8.8.8.8", "rpc_port": 50052})
    assert "Public IP security violation" in public["error"]
    assert "rtt_ms" not in public  # no packet was sent
    assert "malformed" in probe_peer({"node_id": "p"})["error"]
