"""What runs in each daphne process of a LAN controller: `python -m racon.daphne_tls`.

daphne's own command line (daphne.cli), plus HTTPS on an inherited listening socket
(`--tls-fd N --tls-cert C --tls-key K`), the body limit and the idle timeout; racon/serve.py
says why and starts it.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import daphne.server
from daphne import http_protocol
from daphne.cli import CommandLineInterface
from twisted.internet import defer, fdesc, ssl
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface import implementer  # type: ignore[import-untyped]

TLS_PREFIX = "racon-tls:"


def _split_tls_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    own: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--tls-fd", "--tls-cert", "--tls-key"):
            try:
                own[arg[2:]] = next(it)
            except StopIteration:
                raise SystemExit(f"racon.daphne_tls: {arg} needs a value") from None
        else:
            rest.append(arg)
    if own and set(own) != {"tls-fd", "tls-cert", "tls-key"}:
        raise SystemExit("racon.daphne_tls: --tls-fd, --tls-cert and --tls-key go together")
    return own, rest


def _tls_endpoint(reactor: Any, fileno: int, cert: Path, key: Path) -> Any:
    """An IStreamServerEndpoint: the adopted listening socket, every connection wrapped in TLS."""
    options = ssl.PrivateCertificate.loadPEM(cert.read_bytes() + key.read_bytes()).options()

    @implementer(IStreamServerEndpoint)
    class AdoptedTLSEndpoint:
        def listen(self, factory: Any) -> Any:
            wrapped = TLSMemoryBIOFactory(options, False, factory)
            # As Twisted's AdoptedStreamServerEndpoint does: a blocking accept() would stall
            # the reactor (and with it every connection) whenever another process won the race.
            fdesc.setNonBlocking(fileno)
            with socket.socket(fileno=os.dup(fileno)) as probe:
                family = probe.family
            return defer.execute(reactor.adoptStreamPort, fileno, family, wrapped)

    return AdoptedTLSEndpoint()


def _install_limits(max_body: int, idle_timeout: float) -> None:
    """The body limit and idle timeout, on daphne's request and channel factory."""

    class _Sink:
        def write(self, data: bytes) -> None:
            pass

        def seek(self, *a: Any) -> None:
            pass

        def read(self, *a: Any) -> bytes:
            return b""

        def close(self) -> None:
            pass

    class LimitedRequest(http_protocol.WebRequest):
        _refused = False
        _body_seen = 0

        def _refuse(self) -> None:
            self._refused = True
            self.content = _Sink()
            body = f"request body larger than {max_body} bytes\n".encode()
            self.channel.transport.write(
                b"HTTP/1.1 413 Content Too Large\r\nContent-Type: text/plain\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            self.channel.loseConnection()

        def gotLength(self, length: int | None) -> None:  # Twisted's name
            if max_body and length is not None and length > max_body:
                self._refuse()
                return
            super().gotLength(length)

        def handleContentChunk(self, data: bytes) -> None:
            if self._refused:
                return
            self._body_seen += len(data)
            if max_body and self._body_seen > max_body:
                self._refuse()
                return
            super().handleContentChunk(data)

        def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
            if self._refused:
                return
            super().requestReceived(command, path, version)

    base_build = http_protocol.HTTPFactory.buildProtocol

    def build_protocol(self: Any, addr: Any) -> Any:
        protocol = base_build(self, addr)
        protocol.requestFactory = LimitedRequest
        if idle_timeout > 0:
            protocol.timeOut = idle_timeout
        return protocol

    http_protocol.HTTPFactory.buildProtocol = build_protocol


def main(argv: list[str] | None = None) -> None:
    """daphne's command line (`daphne.cli`), plus --tls-fd/--tls-cert/--tls-key and the limits."""
    own, rest = _split_tls_args(list(sys.argv[1:] if argv is None else argv))
    _install_limits(
        int(os.environ.get("RACON_HTTP_MAX_BODY") or 0),
        float(os.environ.get("RACON_HTTP_IDLE_TIMEOUT") or 120),
    )
    if own:
        fileno, cert, key = int(own["tls-fd"]), Path(own["tls-cert"]), Path(own["tls-key"])
        plain = daphne.server.serverFromString

        def server_from_string(reactor: Any, description: str) -> Any:
            if description == f"{TLS_PREFIX}fileno={fileno}":
                return _tls_endpoint(reactor, fileno, cert, key)
            return plain(reactor, description)

        daphne.server.serverFromString = server_from_string
        rest = ["-e", f"{TLS_PREFIX}fileno={fileno}", *rest]
    CommandLineInterface().run(rest)


if __name__ == "__main__":
    main()
