"""The pinned join line of a LAN controller (issue 24): curl's --pinnedpubkey and the Python
route's own check, run for real against a TLS server holding the controller's key or another."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import Client

from apps.nodes.join import PIN_MISMATCH, join_command_line, join_python_line
from racon import tls
from tests.support.enrollment import issue
from tests.support.join import clean_env

pytestmark = pytest.mark.django_db


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, tls.ServerCert, Path]]:
    """A TLS server on loopback with a key from racon/tls.py; any GET answers a script that
    writes a marker file (what a join program would do), both for sh and for Python."""
    ca, _ = tls.ca_load_or_create(var_dir=tmp_path / "var")
    cert, _ = tls.server_cert_ensure(var_dir=tmp_path / "var", ca=ca, ips=["127.0.0.1"])
    marker = tmp_path / "ran"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.endswith(".py"):
                body = f"open({str(marker)!r}, 'w').write('py')\n".encode()
            else:
                body = f"echo sh > {marker}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert.cert_path, cert.key_path)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"https://127.0.0.1:{srv.server_address[1]}", cert, marker
    finally:
        srv.shutdown()
        srv.server_close()


def _run(line: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        ["sh", "-c", line], capture_output=True, text=True, env=clean_env(home),
        cwd=home / "work", timeout=60,
    )  # fmt: skip


def test_a_lan_controllers_line_pins_its_key(settings: object, server: tuple) -> None:
    url, cert, _ = server
    settings.CONTROLLER_PUBLIC_URL = url  # type: ignore[attr-defined]
    settings.TLS_PIN = cert.pin  # type: ignore[attr-defined]
    line = join_command_line(token="rcn_abc")
    assert line.startswith(f"curl -fsSLk --pinnedpubkey {cert.pin} {url}/join/rcn_abc "), line
    assert line.endswith(" | sh")


@pytest.mark.parametrize("route", ["curl", "python"])
def test_the_right_pin_runs_the_script_and_a_wrong_one_is_one_line_and_nothing_runs(
    settings: object,
    server: tuple,
    tmp_path: Path,
    route: str,
) -> None:
    url, cert, marker = server
    settings.CONTROLLER_PUBLIC_URL = url  # type: ignore[attr-defined]
    settings.TLS_PIN = cert.pin  # type: ignore[attr-defined]
    make = join_command_line if route == "curl" else join_python_line
    ok = _run(make(token="rcn_abc"), tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert marker.read_text().strip() == ("sh" if route == "curl" else "py")
    marker.unlink()

    # Another key on the same address: an impersonator with a certificate of its own.
    other = tls.spki_pin(tls.new_key())
    settings.TLS_PIN = other  # type: ignore[attr-defined]
    bad = _run(make(token="rcn_abc"), tmp_path)
    print(f"\n{route}, wrong pin: exit {bad.returncode}: {bad.stderr.strip()}")
    assert bad.returncode != 0
    assert PIN_MISMATCH in bad.stderr
    assert not marker.exists()


def test_a_plain_http_controller_on_a_network_gives_no_line(settings: object) -> None:
    settings.CONTROLLER_PUBLIC_URL = "http://10.1.2.3:8000"  # type: ignore[attr-defined]
    settings.TLS_PIN = ""  # type: ignore[attr-defined]
    settings.INSECURE_LAN = False  # type: ignore[attr-defined]
    line = join_command_line(token="rcn_abc")
    assert (
        line.startswith("# no join line:") and "| sh" not in line and "RACON_INSECURE_LAN" in line
    )
    plaintext = issue()
    body = Client().get(f"/join/{plaintext}").content.decode()
    assert "exit 1" in body and "RACON_INSECURE_LAN" in body
    settings.INSECURE_LAN = True  # type: ignore[attr-defined]
    assert join_command_line(token="rcn_abc") == "curl -fsSL http://10.1.2.3:8000/join/rcn_abc | sh"


def test_loopback_keeps_the_plain_line(settings: object) -> None:
    settings.CONTROLLER_PUBLIC_URL = "http://127.0.0.1:8000"  # type: ignore[attr-defined]
    settings.TLS_PIN = ""  # type: ignore[attr-defined]
    assert (
        join_command_line(token="rcn_abc") == "curl -fsSL http://127.0.0.1:8000/join/rcn_abc | sh"
    )


def test_an_insecure_lan_controller_shows_a_warning_banner(
    settings: object, admin_client: Client
) -> None:
    settings.CONTROLLER_PUBLIC_URL = "http://10.1.2.3:8000"  # type: ignore[attr-defined]
    settings.INSECURE_LAN = True  # type: ignore[attr-defined]
    body = admin_client.get("/nodes/").content.decode()
    assert 'id="insecure-lan-banner"' in body and "RACON_INSECURE_LAN=1" in body
    settings.INSECURE_LAN = False  # type: ignore[attr-defined]
    assert 'id="insecure-lan-banner"' not in admin_client.get("/nodes/").content.decode()
