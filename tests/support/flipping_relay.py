"""An on-path host between a primary and its worker: forwards both ways and, once told, flips one
bit of the next chunk going to the worker (inside a TLS record: its tag no longer verifies). Used
by the tunnel's unit test and the household cluster's."""

from __future__ import annotations

import socket
import threading


class FlippingRelay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.target = target
        self.flip = threading.Event()
        self.flipped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target, timeout=10)
            b.settimeout(None)
            threading.Thread(target=self._pump, args=(a, b, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_worker: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_worker and self.flip.is_set() and not self.flipped.is_set():
                    data = data[:-1] + bytes([data[-1] ^ 0x01])  # in the record's tag
                    self.flipped.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
