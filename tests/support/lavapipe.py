"""The GPU path without a GPU (issue 25): llama.cpp's Vulkan backend on Mesa's lavapipe, shared by
the tests that use it (tests/e2e/test_gpu_lavapipe.py, test_gpu_challenge_lavapipe.py,
tests/cluster/test_gpu_split.py, tests/agent/test_gpu_challenge_child.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Controller, make_account_with_key, start_agent
from tests.support.processes import free_port, wait_for
from tests.support.unavailable import unavailable

LVP_ICD = Path("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
BUILD = Path(sys.prefix) / "llama.cpp"
PROMPT = "The capital of France is"
N_TOKENS = 4


def require_lavapipe() -> None:
    """Skip outside CI without the Vulkan build and Mesa's device; fail under CI, naming the step."""
    missing = [str(p) for p in (BUILD / "lib" / "libggml-vulkan.so", LVP_ICD) if not p.exists()]
    if missing:
        why = (
            f"the Vulkan GPU path needs {', '.join(missing)}: scripts/install-vulkan.sh, then the "
            f"llama.cpp build (make test runs both, as root with apt); {_build_facts()}"
        )
        unavailable(why)


def _build_facts() -> str:
    """What the venv's build and this machine say, so that a failure names its cause: the build's
    backends, the key scripts/platform-key.sh computes now, and a GPU build's failure marker."""
    root = Path(__file__).resolve().parents[2]
    backends = BUILD / "BACKENDS"
    built = backends.read_text().strip() if backends.exists() else "unknown"
    key = subprocess.run(
        [str(root / "scripts/platform-key.sh")], capture_output=True, text=True, check=False
    ).stdout.strip()
    facts = f"the venv's build ({BUILD.resolve()}) has backends {built!r}; platform-key.sh: {key!r}"
    failed = Path(str(BUILD.resolve()).replace("-cpu-rpc", "-cpu-rpc-vulkan", 1) + ".failed")
    if "-vulkan" not in BUILD.resolve().name and failed.exists():
        facts += (
            f"; the Vulkan build failed before: {failed.read_text().strip()!r} (delete {failed})"
        )
    return facts


def lavapipe_env() -> dict[str, str]:
    # lavapipe is a CPU-type device: ggml skips it unless GGML_VK_VISIBLE_DEVICES names it.
    return {"GGML_VK_VISIBLE_DEVICES": "0", "VK_ICD_FILENAMES": str(LVP_ICD)}


def start_named_agent(
    ctl: Controller,
    name: str,
    workdir: Path,
    models_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> Any:
    """A real node-agent named ``name``, enrolled in an account of its own, with ``env`` added
    to its environment only."""
    acct_id, _ = make_account_with_key(f"owner-{name}")
    tok = ctl.post("/api/admin/tokens", {"label": name, "account": acct_id})
    assert tok.status_code == 201, tok.text
    with monkeypatch.context() as m:  # the agent's environment only (Popen copies it)
        for k, v in (env or {}).items():
            m.setenv(k, v)
        return start_agent(
            ctl, tok.json()["token"], name, workdir, models_dir=models_dir, extra=extra
        )


def ready_nodes(ctl: Controller, names: set[str]) -> dict[str, dict[str, Any]] | None:
    """The READY nodes by name once all of ``names`` are READY, else None."""
    got = {n["name"]: n for n in ctl.get("/api/admin/nodes?state=READY").json()}
    return got if names <= got.keys() else None


def models_dir_with(workdir: Path, model_path: Path) -> Path:
    models = workdir / "models"
    models.mkdir(parents=True)
    try:
        os.link(model_path, models / model_path.name)
    except OSError:
        models.joinpath(model_path.name).write_bytes(model_path.read_bytes())
    return models


def cpu_backend_tokens(model_path: Path) -> str:
    """The same build's CPU backend (--device none), bare llama-server, greedy: the reference."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BUILD / "bin" / "llama-server"), "-m", str(model_path), "--device", "none",
         "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-np", "1", "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # died: fail below with its exit code

        wait_for(healthy, 120, "the CPU-backend llama-server")
        assert proc.poll() is None, f"llama-server exited {proc.returncode}"
        body = {"prompt": PROMPT, "n_predict": N_TOKENS, "temperature": 0, "cache_prompt": False}
        return str(httpx.post(url + "/completion", json=body, timeout=120).json()["content"])
    finally:
        proc.terminate()
        proc.wait(timeout=20)
