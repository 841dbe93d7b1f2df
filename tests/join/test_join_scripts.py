"""The join line's scripts as the controller serves them, run the way a contributor runs them.

Bad inputs end with one clear line on stderr, a non-zero exit and nothing installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.nodes.enrollment import enrollment_token_issue, enrollment_token_revoke
from apps.nodes.join import join_command_line, join_python_line
from apps.nodes.models import EnrollmentToken
from racon import ids
from tests.factories import AccountFactory
from tests.support.join import ROOT, clean_env, system_python312

pytestmark = pytest.mark.django_db


def issue(**kw: Any) -> tuple[EnrollmentToken, str]:
    return enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="join", now=timezone.now(), **kw
    )


def run_sh(script: str, home: Path, **env_kw: object) -> subprocess.CompletedProcess[str]:
    env = clean_env(home, **env_kw)  # type: ignore[arg-type]
    return subprocess.run(
        ["sh"], input=script, capture_output=True, text=True, env=env, cwd=home / "work", timeout=60
    )


def assert_refused(proc: subprocess.CompletedProcess[str], home: Path, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("racon join: error: "), lines
    for word in words:
        assert word in lines[0], lines
    assert not (home / ".racon-agent").exists(), "something was installed"


@pytest.mark.parametrize("problem", ["expired", "revoked", "used", "invalid"])
def test_an_unusable_token_gets_a_script_that_refuses_before_installing(
    problem: str, machine: Path
) -> None:
    tok, plaintext = issue()
    if problem == "expired":
        EnrollmentToken.objects.filter(pk=tok.pk).update(
            expires_at=timezone.now() - timedelta(hours=1)
        )
    elif problem == "revoked":
        enrollment_token_revoke(token_id=tok.pk, now=timezone.now())
    elif problem == "used":
        EnrollmentToken.objects.filter(pk=tok.pk).update(uses=1)
    else:
        plaintext = "rcn_" + "x" * 43
    resp = Client().get(f"/join/{plaintext}")
    # 200: `curl -f | sh` would run an empty script (exit 0) on an HTTP error
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/x-shellscript")
    assert_refused(
        run_sh(resp.content.decode(), machine), machine, problem if problem != "used" else "used"
    )
    # The Python variant says the same.
    py = Client().get(f"/join/{plaintext}.py").content.decode()
    proc = subprocess.run(
        [system_python312(), "-"],
        input=py,
        capture_output=True,
        text=True,
        env=clean_env(machine),
        timeout=60,
    )
    assert_refused(proc, machine, problem)
    # And the manifest is refused too.
    assert Client().get(f"/join/{plaintext}/manifest.json?platform=x&abi=cp312").status_code == 410


def test_no_python_312_is_one_line_naming_what_to_install(machine: Path) -> None:
    _, plaintext = issue()
    script = Client().get(f"/join/{plaintext}").content.decode()
    # The Python route (the line's default, the standalone bundle, needs no Python at all).
    proc = run_sh(script, machine, with_python=False, RACON_JOIN_ROUTE="python")
    assert proc.returncode == 3
    assert_refused(proc, machine, "Python 3.12", "install python3.12")


def test_fetching_the_script_does_not_consume_the_token() -> None:
    tok, plaintext = issue()
    c = Client()
    for path in (f"/join/{plaintext}", f"/join/{plaintext}.py"):
        body = c.get(path).content.decode()
        assert plaintext in body and "error" not in body.splitlines()[1]
    tok.refresh_from_db()
    assert tok.uses == 0


def test_the_token_lines_name_the_join_url(settings: object) -> None:
    line = join_command_line(token="rcn_abc")
    assert line.startswith("curl -fsSL ") and line.endswith("/join/rcn_abc | sh")
    assert "/join/rcn_abc.py" in join_python_line(token="rcn_abc")


def test_the_admin_api_returns_the_join_lines(admin_client: Client) -> None:
    from apps.accounts.models import Account

    Account.objects.get_or_create(name="default") if hasattr(Account, "name") else None
    resp = admin_client.post("/api/admin/tokens", {"label": "box"}, content_type="application/json")
    assert resp.status_code == 201, resp.content[:200]
    body = resp.json()
    assert body["join_command"] == join_command_line(token=body["token"])
    assert body["join_python_command"] == join_python_line(token=body["token"])


def test_the_join_program_computes_the_same_platform_key_as_the_build() -> None:
    program = (
        (ROOT / "packaging/join/join.py")
        .read_text()
        .replace("\nentry()\n", "\nprint(platform_key())\n")
    )
    key = subprocess.run(
        [sys.executable, "-"], input=program, capture_output=True, text=True, check=True
    ).stdout.strip()
    expected = subprocess.run(
        [str(ROOT / "scripts/platform-key.sh")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert key == expected
    # A plain user's PATH has no /usr/sbin: the key (and so the build's GPU backends) is the same.
    plain = subprocess.run(
        [str(ROOT / "scripts/platform-key.sh")],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")},
    ).stdout.strip()
    assert plain == expected


def test_the_controller_and_the_builder_hash_the_agent_source_alike() -> None:
    import runpy

    from apps.nodes import join

    builder = runpy.run_path(str(ROOT / "scripts/build-wheelhouse.py"), run_name="builder")
    assert builder["agent_source_hash"]() == join.agent_source_hash()


def test_a_wheelhouse_file_needs_a_token_or_a_node_credential(
    tmp_path: Path, settings: object
) -> None:
    d = tmp_path / "source"
    d.mkdir()
    (d / "a.txt").write_text("x")
    (d / "secret.txt").write_text("no")
    (d / "manifest.json").write_text(
        json.dumps({"files": [{"name": "a.txt", "sha256": "0", "size": 1, "kind": "script"}]})
    )
    settings.JOIN_WHEELHOUSE_DIR = str(tmp_path)  # type: ignore[attr-defined]
    _, plaintext = issue()
    c = Client()
    assert c.get("/join/files/source/a.txt").status_code == 401
    ok = c.get("/join/files/source/a.txt", HTTP_AUTHORIZATION=f"Join {plaintext}")
    assert ok.status_code == 200 and b"".join(ok.streaming_content) == b"x"  # type: ignore[attr-defined]
    for name in ("secret.txt", "../source/a.txt", "manifest.json"):
        assert (
            c.get(f"/join/files/source/{name}", HTTP_AUTHORIZATION=f"Join {plaintext}").status_code
            == 404
        )
