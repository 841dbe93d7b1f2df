"""The standalone agent bundle runs on a machine with no Python at all (issue 26).

scripts/build-bundle.sh builds it (cached under ~/.cache/racon/bundle); the test unpacks it and
runs `node-agent --help` and `node-agent doctor` with `env -i` in a mount namespace where every
Python of this machine, the checkout's .venv and ~/.cache/racon are masked (tests/cluster/
no_python.py). Needs root for the mount namespace (CI runs as root).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.cluster.no_python import build_bundle, without_python

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="masking every Python needs a mount namespace (root); CI runs as root"
)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tarball = build_bundle()
    dest = tmp_path_factory.mktemp("bundle")
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="tar")
    return dest / "node-agent"


def run_bare(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "LANG": "C.UTF-8"}
    return subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_bundle_lists_its_pieces_and_a_glibc_floor(bundle_dir: Path) -> None:
    info = json.loads((bundle_dir / "BUNDLE.json").read_text())
    assert info["machine"] == os.uname().machine
    assert info["glibc"].startswith("2.")
    llama = bundle_dir / "_internal" / "llama.cpp"
    for exe in ("llama-server", "ggml-rpc-server"):
        assert os.access(llama / "bin" / exe, os.X_OK)
    assert (llama / "lib" / "libggml.so.0").is_file()
    assert not list(bundle_dir.rglob("llama_cpp"))  # no llama-cpp-python inside


def test_the_bundle_runs_where_no_python_exists(bundle_dir: Path, tmp_path: Path) -> None:
    exe = str(bundle_dir / "node-agent")
    probe = run_bare(
        without_python(["sh", "-c", "python3 -c 1 || echo no-python"], tmp_path / "empty"),
        tmp_path,
    )
    assert "no-python" in probe.stdout, probe.stdout + probe.stderr

    helped = run_bare(without_python([exe, "--help"], tmp_path / "empty"), tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "install-service" in helped.stdout and "upgrade" in helped.stdout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    doctor = run_bare(
        without_python(
            [exe, "doctor", "--no-benchmark", "--state-dir", str(tmp_path / "st"),
             "--controller-url", dead],
            tmp_path / "empty",
        ),
        tmp_path,
    )  # fmt: skip
    out = doctor.stdout + doctor.stderr
    assert "[ok] hardware: detected" in out, out
    # llama-server and ggml-rpc-server load their own libraries (RPATH $ORIGIN), not the build's.
    assert f"[ok] llama.cpp rpc: llama-server and ggml-rpc-server in {bundle_dir}" in out, out
    assert "[FAIL] controller:" in out and doctor.returncode == 1
