"""A user-space wire between network namespaces: per-link delay and rate (no netem here).

FACTS.md: this kernel has no netem, so a link's delay must come from user space. A TCP relay
would hide the client's address from the worker's RPC tunnel (agent/tunnel.py checks that the
peer is the plan's primary), so the relay works one layer down, on IP packets: each host
namespace (and the root one, where the controller runs) gets a TUN device, and this process
moves every packet between them. A packet from host A to host B crosses A's link (paced to A's
rate, then held for A's delay) and B's link (paced to B's rate, then held for B's delay), each
link with its own FIFO, so both directions see the delay and the rate, addresses are real, and a
packet that would wait longer than the link's buffer is dropped like a router's tail drop.

Run by tests/cluster/harness.py as root:

    python -m tests.cluster.netwire CONFIG.json

CONFIG: {"links": {"<name>": {"netns": "<ns or null for this one>", "dev": "<tun name>",
"address": "10.213.X.N", "delay_ms": 0, "rate_mbit": 0}}}; rate 0 means unlimited. The file is
re-read when it changes (a link that degrades while the cluster runs). The wire prints "ready"
once every TUN device exists, and exits on SIGTERM; the devices vanish with it.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 65000
READ_SIZE = 65536
# A link buffers at most this long a wait (or at least MIN_BUFFER_BYTES): beyond it, tail drop.
BUFFER_SECONDS = 0.25
MIN_BUFFER_BYTES = 512 * 1024


def open_tun(name: str, netns: str | None) -> int:
    """Create a (non-persistent) TUN device in netns and return its fd; the fd stays ours."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        if netns:
            target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                os.setns(target, os.CLONE_NEWNET)
            finally:
                os.close(target)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        return fd
    finally:
        os.setns(own, os.CLONE_NEWNET)
        os.close(own)


@dataclass
class Link:
    name: str
    fd: int
    address: str
    delay_s: float = 0.0
    rate_bps: float = 0.0  # bits/s; 0 = unlimited
    up_free: float = 0.0  # when this link's uplink queue is next idle
    down_free: float = 0.0
    queue: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    timer: asyncio.TimerHandle | None = None
    sent: int = 0
    dropped: int = 0

    def configure(self, spec: dict[str, Any]) -> None:
        self.delay_s = float(spec.get("delay_ms", 0)) / 1000
        self.rate_bps = float(spec.get("rate_mbit", 0)) * 1e6

    def serialize(self, size: int) -> float:
        return size * 8 / self.rate_bps if self.rate_bps > 0 else 0.0

    def buffer_s(self) -> float:
        if self.rate_bps <= 0:
            return float("inf")
        return max(BUFFER_SECONDS, MIN_BUFFER_BYTES * 8 / self.rate_bps)


class Wire:
    def __init__(self, config: Path) -> None:
        self.config = config
        self.mtime = 0.0
        self.links: dict[str, Link] = {}
        self.by_addr: dict[bytes, Link] = {}
        self.loop = asyncio.get_event_loop()

    def load(self, *, create: bool) -> None:
        raw = json.loads(self.config.read_text())
        self.mtime = self.config.stat().st_mtime
        for name, spec in raw["links"].items():
            link = self.links.get(name)
            if link is None:
                if not create:
                    continue
                link = Link(
                    name=name, fd=open_tun(spec["dev"], spec.get("netns")), address=spec["address"]
                )
                self.links[name] = link
                self.by_addr[socket.inet_aton(spec["address"])] = link
            link.configure(spec)

    def reload_if_changed(self) -> None:
        try:
            if self.config.stat().st_mtime != self.mtime:
                self.load(create=False)
        except (OSError, ValueError, KeyError) as exc:
            print(f"netwire: config not reloaded: {exc}", file=sys.stderr, flush=True)
        self.loop.call_later(0.2, self.reload_if_changed)

    def start(self) -> None:
        for link in self.links.values():
            self.loop.add_reader(link.fd, self.on_readable, link)
        self.loop.call_later(0.2, self.reload_if_changed)

    def on_readable(self, src: Link) -> None:
        for _ in range(64):
            try:
                pkt = os.read(src.fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                return
            if len(pkt) < 20 or pkt[0] >> 4 != 4:
                continue  # IPv4 only (the harness turns IPv6 off)
            dst = self.by_addr.get(pkt[16:20])
            if dst is None or dst is src:
                continue
            self.forward(src, dst, pkt)

    def forward(self, src: Link, dst: Link, pkt: bytes) -> None:
        now = time.monotonic()
        size = len(pkt)
        start_up = max(now, src.up_free)
        if start_up - now > src.buffer_s():
            src.dropped += 1
            return
        src.up_free = start_up + src.serialize(size)
        at_switch = src.up_free + src.delay_s
        start_down = max(at_switch, dst.down_free)
        if start_down - at_switch > dst.buffer_s():
            dst.dropped += 1
            return
        dst.down_free = start_down + dst.serialize(size)
        deliver = dst.down_free + dst.delay_s
        # The queue is FIFO by construction: deliveries to one link never go back in time.
        if dst.queue and deliver < dst.queue[-1][0]:
            deliver = dst.queue[-1][0]
        dst.queue.append((deliver, pkt))
        if dst.timer is None:
            self.arm(dst)

    def arm(self, dst: Link) -> None:
        when = dst.queue[0][0]
        delay = max(0.0, when - time.monotonic())
        dst.timer = self.loop.call_later(delay, self.deliver, dst)

    def deliver(self, dst: Link) -> None:
        dst.timer = None
        now = time.monotonic()
        while dst.queue and dst.queue[0][0] <= now + 0.0002:
            _, pkt = dst.queue.popleft()
            try:
                os.write(dst.fd, pkt)
                dst.sent += 1
            except OSError:
                dst.dropped += 1
        if dst.queue:
            self.arm(dst)


def main() -> None:
    config = Path(sys.argv[1])
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    wire = Wire(config)
    wire.load(create=True)
    wire.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    loop.run_until_complete(stop.wait())
    for link in wire.links.values():
        print(f"netwire: {link.name} delivered {link.sent} dropped {link.dropped}", file=sys.stderr)
        os.close(link.fd)


if __name__ == "__main__":
    main()
