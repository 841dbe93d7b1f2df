"""`racon bundle upload|ls` against a mock controller (the upload endpoint itself is exercised for
real in tests/join/test_join_bundle.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from racon_cli import main as cli
from racon_cli.commands import common

MANIFEST = {
    "platform": "linux-aarch64-asimd-cpu-rpc",
    "machine": "aarch64",
    "glibc": "2.35",
    "agent_version": "0.1.0",
    "files": [
        {"name": "node-agent-0.1.0-aarch64-k.tar.gz", "size": 48_000_000, "sha256": "ab" * 32}
    ],
}


def invoke(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, seen: list[httpx.Request], *args: str
) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST" and request.url.path == "/api/admin/bundles":
            return httpx.Response(201, json=MANIFEST)
        if request.url.path == "/api/admin/bundles":
            flat = {**MANIFEST, **MANIFEST["files"][0]}  # type: ignore[dict-item]
            return httpx.Response(200, json=[flat])
        return httpx.Response(404, json={"error": {"message": "no", "code": "not_found"}})

    transport = httpx.MockTransport(handler)
    real = common.Client

    class Mocked(real):  # type: ignore[misc, valid-type]
        def __init__(self, url: str, key: str, **kw: Any) -> None:
            super().__init__(url, key, transport=transport, **kw)

    monkeypatch.setattr(common, "Client", Mocked)
    env = {"RACON_URL": "http://c.test", "RACON_API_KEY": "rk", "RACON_CONFIG": str(tmp_path / "c")}
    return CliRunner().invoke(cli.app, list(args), env=env, catch_exceptions=False)


def test_upload_sends_the_tarball_with_its_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tarball = tmp_path / "node-agent-0.1.0-aarch64-k.tar.gz"
    tarball.write_bytes(b"\x1f\x8b" + b"x" * 100)
    seen: list[httpx.Request] = []
    result = invoke(monkeypatch, tmp_path, seen, "bundle", "upload", str(tarball))
    assert result.exit_code == 0, result.output
    (req,) = seen
    assert req.url.params["name"] == tarball.name and req.content == tarball.read_bytes()
    assert req.headers["Content-Type"] == "application/gzip"
    assert "for linux-aarch64-asimd-cpu-rpc (glibc >= 2.35)" in " ".join(result.output.split())


def test_upload_of_a_missing_file_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[httpx.Request] = []
    result = invoke(monkeypatch, tmp_path, seen, "bundle", "upload", str(tmp_path / "nope.tar.gz"))
    assert result.exit_code == 4 and not seen
    assert "no such file" in result.output


def test_ls_lists_platform_glibc_and_size(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = invoke(monkeypatch, tmp_path, [], "bundle", "ls")
    assert result.exit_code == 0, result.output
    assert "linux-aarch64-asimd-cpu-rpc" in result.output and ">= 2.35" in result.output
