"""RPC worker refusals that happen before any process starts (no llama.cpp needed)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from agent.protocol import PublicAddressError
from agent.runtime import PortInUse
from agent.runtime.rpc_worker import RpcWorker, check_port_free


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, event: str, message: str, data: dict[str, Any]) -> None:
        self.items.append((event, message, data))

    def named(self, name: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [e for e in self.items if e[0] == name]


def test_a_worker_refuses_a_port_in_use_and_a_public_address(tmp_path: Path) -> None:
    events = Events()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        w = RpcWorker(
            host="127.0.0.1",
            port=port,
            cache_dir=tmp_path,
            n_threads=1,
            log_path=tmp_path / "w.log",
            on_event=events,
        )
        with pytest.raises(PortInUse, match="already in use"):
            w.start()
    assert not w.running
    assert "already in use" in events.named("RPC_WORKER_FAILED")[0][1]
    public = RpcWorker(
        host="8.8.8.8",
        port=50052,
        cache_dir=tmp_path,
        n_threads=1,
        log_path=tmp_path / "w.log",
        on_event=events,
    )
    with pytest.raises(PublicAddressError):
        public.start()
    assert events.named("PUBLIC_IP_VIOLATION")[0][1].startswith("Public IP security violation")
    assert not (tmp_path / "w.log").exists()  # nothing was ever started


def test_a_foreign_address_is_reported_as_not_this_machine() -> None:
    with pytest.raises(PortInUse, match="not an address of this machine"):
        check_port_free("10.254.254.254", 50052)
