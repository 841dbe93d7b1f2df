"""The CLI runs on a `pip install racon[cli]`: it needs the base dependencies and the `cli` extra
only, and never Django (it is a client of the REST API).

A CLI-only install is played in a subprocess: every installed distribution outside those
requirements (and what they pull in) is made unimportable there, so a stray import fails as it
would on a user's machine, while a library's own guarded optional import (httpx tries `click` for
its command line) falls back as it would there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from apps.credits import signing

ROOT = Path(__file__).resolve().parents[2]
# Top-level packages of this repository: checked by name below, never blocked.
OWN = {"racon_cli", "apps", "racon", "agent", "tests", "bench"}

_BLOCK = """
import json, os, sys
BLOCKED = frozenset(json.loads(os.environ["RACON_TEST_BLOCKED"]))

class NotInACliInstall:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in racon[cli])", name=name)
        return None

sys.meta_path.insert(0, NotInACliInstall())
"""
# Modules without a file are left out: builtins, and the submodules an extension registers under
# names of their own (cryptography's Rust core adds `_openssl`); the extension's own file counts.
_IMPORT_ALL = (
    _BLOCK
    + """
before = set(sys.modules)
import racon_cli.main, racon_cli.top
from racon_cli.commands import chat, common, credits, deployments, jobs, models, nodes, session
from racon_cli.commands import tokens, top
new = set(sys.modules) - before
print(json.dumps(sorted(m for m in new if getattr(sys.modules[m], "__file__", None))))
"""
)
_RUN_CLI = (
    _BLOCK
    + """
import racon_cli.main
sys.argv = ["racon", *sys.argv[1:]]
racon_cli.main.main()
"""
)

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """Distributions these requirements pull in, transitively, as installed here (extras followed;
    other markers are not evaluated, which can only allow more)."""
    extras_of: dict[str, set[str]] = {}
    todo = list(requirements)
    while todo:
        m = _REQ.match(todo.pop())
        assert m, "unparsable requirement"
        name = _norm(m[1])
        extras = {_norm(e) for e in (m[2] or "").split(",") if e.strip()}
        if name in extras_of and extras <= extras_of[name]:
            continue
        extras_of.setdefault(name, set()).update(extras)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            spec, _, marker = req.partition(";")
            wanted = {_norm(e) for e in _EXTRA.findall(marker)}
            if not wanted or wanted & extras_of[name]:
                todo.append(spec)
    return set(extras_of)


def _blocked() -> list[str]:
    """Installed top-level modules that a `racon[cli]` install would not have."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = _closure([*project["dependencies"], *project["optional-dependencies"]["cli"]])
    stdlib = sys.stdlib_module_names | set(sys.builtin_module_names)
    return sorted(
        top
        for top, dists in metadata.packages_distributions().items()
        if top not in stdlib and top not in OWN and not {_norm(d) for d in dists} & allowed
    )


def _cli_only(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["RACON_TEST_BLOCKED"] = json.dumps(_blocked())
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_blocklist_holds_what_a_cli_install_lacks() -> None:
    blocked = set(_blocked())
    assert {"django", "rest_framework", "celery"} <= blocked  # the controller's stack
    assert not {"httpx", "httpx_sse", "typer", "rich", "textual", "cryptography"} & blocked


def test_every_command_imports_on_a_cli_install_without_django() -> None:
    proc = _cli_only(_IMPORT_ALL)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert not [m for m in loaded if m == "django" or m.startswith("django.")]
    # `apps` is there for the pure receipt check of `credits verify` only; the Django project
    # package (`racon`) and the agent stay out.
    assert not [m for m in loaded if m.partition(".")[0] in {"racon", "agent"}]
    assert "cryptography" in {m.partition(".")[0] for m in loaded}  # what `credits verify` needs


def test_credits_verify_runs_on_a_cli_install(tmp_path: Path) -> None:
    key = signing.private_key_generate()
    payload = {
        "version": signing.RECEIPT_VERSION,
        "receipt_id": "r7",
        "credits": 5,
        "node_name": "box",
        "job_id": "j",
    }
    (tmp_path / "r.json").write_text(
        json.dumps({**payload, "signature": signing.receipt_sign(payload, key)})
    )
    (tmp_path / "k.pem").write_text(signing.public_key_pem(key))
    proc = _cli_only(
        _RUN_CLI, "credits", "verify", "r.json", "--public-key", "k.pem", "--json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"valid": True, "reason": "ok"}
