from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import agent.models as models
from agent.models import FetchError, ShaCache, fetch_model, resolve_model, scan_models

DATA = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(DATA).hexdigest()


def test_sha_cache_hashes_once_per_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(DATA)
    calls: list[Path] = []
    real = models.sha256_file
    monkeypatch.setattr(models, "sha256_file", lambda p: calls.append(p) or real(p))
    cache = ShaCache(tmp_path / "state")
    assert cache.sha256(f) == SHA
    assert ShaCache(tmp_path / "state").sha256(f) == SHA  # persisted across instances
    assert len(calls) == 1
    f.write_bytes(DATA + b"x")
    assert cache.sha256(f) != SHA
    assert len(calls) == 2


def test_scan_finds_gguf_files_and_resolve_finds_them_by_sha(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "sub").mkdir(parents=True)
    (models / "sub" / "a.gguf").write_bytes(DATA)
    (models / "notes.txt").write_text("ignored")
    cache = ShaCache(tmp_path)
    found = scan_models(models, cache)
    assert [m["file_name"] for m in found] == ["a.gguf"]
    assert found[0]["sha256"] == SHA and found[0]["size"] == len(DATA)
    assert (
        resolve_model(models, cache, sha256=SHA, model_path=None)
        == (models / "sub" / "a.gguf").resolve()
    )
    assert resolve_model(models, cache, sha256="0" * 64, model_path=None) is None
    assert resolve_model(models, cache, sha256=SHA, model_path="missing.gguf") is None
    assert scan_models(tmp_path / "nope", cache) == []


def ranged_server(data: bytes, *, fail_after: int | None = None, corrupt_times: int = 0):  # type: ignore[no-untyped-def]
    state: dict[str, Any] = {"requests": [], "corrupt": corrupt_times, "failed": False}

    def handler(request: httpx.Request) -> httpx.Response:
        rng = request.headers.get("Range")
        state["requests"].append(rng)
        body = data
        if state["corrupt"] > 0:
            state["corrupt"] -= 1
            body = b"\0" * len(data)
        start = int(rng.split("=")[1].rstrip("-")) if rng else 0
        if fail_after is not None and not state["failed"]:
            state["failed"] = True
            # A connection that drops mid-body: the client sees a read error after some bytes.
            return httpx.Response(200, stream=_Broken(body[:fail_after]))
        if rng:
            return httpx.Response(206, content=body[start:])
        return httpx.Response(200, content=body)

    return httpx.MockTransport(handler), state


class _Broken(httpx.SyncByteStream):
    def __init__(self, head: bytes) -> None:
        self.head = head

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield self.head
        raise httpx.ReadError("connection reset")


def test_fetch_resumes_an_interrupted_download_with_a_range_request(tmp_path: Path) -> None:
    transport, state = ranged_server(DATA, fail_after=300_000)
    path = fetch_model(
        url="http://ctl/files/m",
        dest_dir=tmp_path,
        file_name="m.gguf",
        sha256=SHA,
        size=len(DATA),
        transport=transport,
    )
    assert path.read_bytes() == DATA
    assert state["requests"] == [None, "bytes=300000-"]
    assert not (tmp_path / "m.gguf.part").exists()


def test_fetch_retries_once_on_sha_mismatch_then_succeeds(tmp_path: Path) -> None:
    transport, state = ranged_server(DATA, corrupt_times=1)
    path = fetch_model(
        url="http://ctl/f",
        dest_dir=tmp_path,
        file_name="m.gguf",
        sha256=SHA,
        size=len(DATA),
        transport=transport,
    )
    assert path.read_bytes() == DATA
    assert len(state["requests"]) == 2


def test_fetch_gives_up_after_two_mismatches_and_keeps_no_bad_file(tmp_path: Path) -> None:
    transport, _ = ranged_server(DATA, corrupt_times=5)
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetch_model(
            url="http://ctl/f",
            dest_dir=tmp_path,
            file_name="m.gguf",
            sha256=SHA,
            size=len(DATA),
            transport=transport,
        )
    assert list(tmp_path.iterdir()) == []


def test_fetch_refuses_path_traversal_in_the_file_name(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="plain file name"):
        fetch_model(
            url="http://x/f",
            dest_dir=tmp_path,
            file_name="../evil.gguf",
            sha256=SHA,
            size=1,
            stop=threading.Event(),
        )
