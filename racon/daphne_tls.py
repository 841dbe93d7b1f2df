"""What runs in each daphne process of a LAN controller: `python -m racon.daphne_tls`.

daphne's own command line (daphne.cli), plus HTTPS on an inherited listening socket
(`--tls-fd N --tls-cert C --tls-key K`), the body limits per route and the header and idle
timeouts; racon/serve.py says why and starts it.
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
from django.conf import settings
from twisted.internet import defer, fdesc, ssl
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.protocol import connectionDone
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.web import http
from zope.interface import implementer  # type: ignore[import-untyped]

from racon.http_limits import route_body_limit

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


def _install_limits(default_body: int, idle_timeout: float, header_timeout: float) -> None:
    """Body limits per route (racon/http_limits.py: ``default_body`` but for the upload routes),
    the header timeout and the idle timeout, on daphne's request and channel factory: all of it
    before daphne reads a body or calls the application."""

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
        _max_body = 0

        def _refuse(self) -> None:
            self._refused = True
            self.content = _Sink()
            body = f"request body larger than {self._max_body} bytes\n".encode()
            self.channel.transport.write(
                b"HTTP/1.1 413 Content Too Large\r\nContent-Type: text/plain\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            self.channel.loseConnection()

        def gotLength(self, length: int | None) -> None:  # Twisted's name: all headers are in
            channel = self.channel
            if isinstance(channel, LimitedChannel):
                channel.headers_complete()
            path = getattr(channel, "_path", b"").decode("latin-1")
            self._max_body = route_body_limit(path, default=default_body)
            if self._max_body and length is not None and length > self._max_body:
                self._refuse()
                return
            super().gotLength(length)

        def handleContentChunk(self, data: bytes) -> None:
            if self._refused:
                return
            self._body_seen += len(data)
            if self._max_body and self._body_seen > self._max_body:
                self._refuse()
                return
            super().handleContentChunk(data)

        def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
            if self._refused:
                return
            super().requestReceived(command, path, version)

    class LimitedChannel(http.HTTPChannel):
        """A request's headers must be complete within header_timeout of its first byte (a
        slow sender of headers is otherwise held only by the idle timeout, which each byte
        resets)."""

        _awaiting_headers = True
        _header_call: Any = None

        def dataReceived(self, data: bytes) -> None:
            if self._awaiting_headers and self._header_call is None and header_timeout > 0:
                self._header_call = self.callLater(header_timeout, self._headers_too_slow)
            super().dataReceived(data)

        def headers_complete(self) -> None:
            self._awaiting_headers = False
            if self._header_call is not None and self._header_call.active():
                self._header_call.cancel()
            self._header_call = None

        def _headers_too_slow(self) -> None:
            self._header_call = None
            transport: Any = self.transport
            if not self._awaiting_headers or transport is None:
                return
            transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            self.loseConnection()

        def requestDone(self, request: Any) -> None:
            self._awaiting_headers = True  # the next request's (pipelined data comes next)
            super().requestDone(request)

        def connectionLost(self, reason: Failure = connectionDone) -> None:
            if self._header_call is not None and self._header_call.active():
                self._header_call.cancel()
            self._header_call = None
            super().connectionLost(reason)

    base_build = http_protocol.HTTPFactory.buildProtocol

    def build_protocol(self: Any, addr: Any) -> Any:
        protocol = base_build(self, addr)
        channel = getattr(protocol, "_channel", None)
        if type(channel) is http.HTTPChannel:
            channel.__class__ = LimitedChannel  # HTTP/1.1; an HTTP/2 channel keeps its own
        protocol.requestFactory = LimitedRequest
        if idle_timeout > 0:
            protocol.timeOut = idle_timeout
        return protocol

    http_protocol.HTTPFactory.buildProtocol = build_protocol


def main(argv: list[str] | None = None) -> None:
    """daphne's command line (`daphne.cli`), plus --tls-fd/--tls-cert/--tls-key and the limits."""
    own, rest = _split_tls_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "racon.settings")
    _install_limits(
        int(settings.HTTP_MAX_BODY_BYTES),
        float(settings.HTTP_IDLE_TIMEOUT_SECONDS),
        float(settings.HTTP_HEADER_TIMEOUT_SECONDS),
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
