"""The join line's standalone route (issue 26) against a live server: the controller picks the
bundle a machine can run, and the line (sh + curl only) checks the architecture, the glibc floor,
the disk and the sha256 before it writes anything, then installs under ~/.racon-agent and starts
the agent. A small fake bundle stands in for the real one (office-pc in
tests/cluster/test_household.py joins with the real one); its `node-agent` records how it was started.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.bundle import BundleError, bundle_home, upgrade_bundle
from agent.identity import Identity
from apps.nodes import bundles, join
from apps.nodes.enrollment import enrollment_token_issue
from racon import ids
from tests.factories import AccountFactory, NodeFactory
from tests.support.join import clean_env

pytestmark = pytest.mark.django_db(transaction=True)

AGENT = """#!/bin/sh
printf '%s\\n' "$@" > "$HOME/started-with"
[ -n "$RACON_ENROLLMENT_TOKEN" ] && echo token-in-env >> "$HOME/started-with"
echo "controller=$RACON_CONTROLLER_URL" >> "$HOME/started-with"
"""


def fake_bundle(
    *, platform: str, machine: str, glibc: str = "2.17", version: str = "0.1.0"
) -> tuple[str, bytes]:
    info = {"agent_version": version, "platform": platform, "machine": machine, "glibc": glibc}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body, mode in (
            ("node-agent/node-agent", AGENT.encode(), 0o755),
            ("node-agent/BUNDLE.json", json.dumps(info).encode(), 0o644),
        ):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(body), mode
            tar.addfile(ti, io.BytesIO(body))
    return f"node-agent-{version}-{machine}-test.tar.gz", buf.getvalue()


def publish(root: Path, *, tamper: bool = False, **kw: str) -> dict[str, Any]:
    name, data = fake_bundle(**kw)
    info = json.loads(
        tarfile.open(fileobj=io.BytesIO(data)).extractfile("node-agent/BUNDLE.json").read()
    )
    d = root / "bundles" / info["platform"]
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("node-agent-*"):
        old.unlink()
    (d / name).write_bytes(data)
    sha = hashlib.sha256(b"other" if tamper else data).hexdigest()
    manifest = {
        **info,
        "agent_source": join.agent_source_hash(),
        "files": [{"name": name, "kind": "bundle", "size": len(data), "sha256": sha}],
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.fixture
def served(live_server: Any, settings: Any, tmp_path: Path) -> Path:
    settings.CONTROLLER_PUBLIC_URL = live_server.url
    settings.JOIN_WHEELHOUSE_DIR = str(tmp_path / "wheelhouse")
    settings.JOIN_REBUILD = False
    return tmp_path / "wheelhouse"


def own() -> tuple[str, str]:
    key = join.own_platform()[0]
    return key, os.uname().machine


def run_line(home: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="b", now=timezone.now()
    )
    line = join.join_command_line(token=token)
    env = clean_env(home, extra, with_python=False, RACON_JOIN_ROUTE="bundle")
    return subprocess.run(
        ["sh", "-c", line + " -s -- --node-name b1"], capture_output=True, text=True, env=env,
        cwd=home / "work", timeout=120,
    )  # fmt: skip


def refused(proc: subprocess.CompletedProcess[str], home: Path, code: int, *words: str) -> str:
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == code, proc.stderr
    assert len(errors) == 1 and all(w in errors[0] for w in words), proc.stderr
    assert not (home / ".racon-agent").exists(), "something was installed"
    return errors[0]


def test_the_line_installs_the_bundle_and_starts_the_agent(served: Path, machine: Path) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch)
    proc = run_line(machine)
    assert proc.returncode == 0, proc.stderr
    home = machine / ".racon-agent"
    link = home / "agent"
    assert link.is_symlink() and os.readlink(link).startswith("bundles/node-agent-0.1.0-")
    started = (machine / "started-with").read_text().splitlines()
    assert started[:3] == ["--foreground", "--node-name", "b1"]
    assert "token-in-env" in started  # the token travels in the environment only
    assert "racon join: installed in" in proc.stderr
    assert "vLLM" in proc.stderr and "WebKitGTK" in proc.stderr
    assert not list(home.glob(".download-*"))


def test_a_corrupted_download_is_the_sha256_line_and_nothing_installed(
    served: Path, machine: Path
) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch, tamper=True)
    refused(run_line(machine), machine, 5, "sha256 mismatch", "nothing was installed")


def test_another_architecture_is_one_line_naming_both(served: Path, machine: Path) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch)
    line = refused(run_line(machine, RACON_JOIN_MACHINE="riscv64"), machine, 6, "riscv64", arch)
    assert "racon bundle build" in line and key in line


def test_an_older_glibc_is_refused_before_anything_is_written(served: Path, machine: Path) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch, glibc="2.36")
    refused(
        run_line(machine, RACON_JOIN_GLIBC="2.31"), machine, 6, "glibc is 2.31", "2.36 or newer"
    )


def test_not_enough_disk_is_exit_4(served: Path, machine: Path) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch)
    refused(run_line(machine, RACON_JOIN_FREE_BYTES="1000"), machine, 4, "not enough disk space")


def test_no_bundle_at_all_says_how_to_build_one(served: Path, machine: Path) -> None:
    refused(run_line(machine), machine, 6, "no agent bundle yet", "racon bundle build")


def test_a_cpu_without_the_bundles_features_is_told_which(served: Path) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch)
    bundle, why = bundles.pick(arch, set())
    assert bundle is None and f"this machine's {arch} CPU lacks " in why
    assert all(f in why for f in bundles.key_features(key)[2]) and "racon bundle build" in why


def test_an_operator_uploads_a_bundle_for_another_platform(
    served: Path, admin_client: Client
) -> None:
    name, data = fake_bundle(platform="linux-aarch64-asimd-cpu-rpc", machine="aarch64")
    resp = admin_client.post(
        f"/api/admin/bundles?name={name}", data=data, content_type="application/gzip"
    )
    assert resp.status_code == 201, resp.content
    assert resp.json()["files"][0]["sha256"] == hashlib.sha256(data).hexdigest()
    listed = admin_client.get("/api/admin/bundles").json()
    assert [b["platform"] for b in listed] == ["linux-aarch64-asimd-cpu-rpc"]
    bundle, _ = bundles.pick("aarch64", {"asimd", "neon"})
    assert bundle is not None and bundle["files"][0]["name"] == name
    bad = admin_client.post(
        "/api/admin/bundles?name=node-agent-x.tar.gz", data=b"junk", content_type="application/gzip"
    )
    assert bad.status_code == 400 and "not an agent bundle" in bad.json()["error"]["message"]


def test_upgrade_switches_to_the_new_bundle_atomically_and_keeps_the_previous(
    served: Path, machine: Path, live_server: Any
) -> None:
    key, arch = own()
    publish(served, platform=key, machine=arch)
    assert run_line(machine, RACON_JOIN_NO_START="1").returncode == 0
    home = machine / ".racon-agent"
    first = os.readlink(home / "agent")
    assert bundle_home(str(home / "agent" / "node-agent")) == home
    ident = Identity(str(NodeFactory().id), "cred", live_server.url, "redis://x", "n")
    assert upgrade_bundle(ident, home) == ""  # already current
    publish(served, platform=key, machine=arch, version="0.2.0", tamper=True)
    with pytest.raises(BundleError, match="sha256 mismatch"):
        upgrade_bundle(ident, home)
    assert os.readlink(home / "agent") == first  # nothing changed
    publish(served, platform=key, machine=arch, version="0.2.0")
    assert upgrade_bundle(ident, home) == "0.2.0"
    assert os.readlink(home / "agent") == "bundles/node-agent-0.2.0-" + arch + "-test"
    assert (home / "agent" / "node-agent").is_file()
    kept = sorted(p.name for p in (home / "bundles").iterdir())
    assert kept == sorted([first.removeprefix("bundles/"), "node-agent-0.2.0-" + arch + "-test"])


def test_the_wheelhouse_manifest_lists_the_bundle(served: Path, client: Client) -> None:
    key, arch = own()
    m = publish(served, platform=key, machine=arch, glibc="2.36")
    house = served / key / "cp312"
    house.mkdir(parents=True)
    (house / "manifest.json").write_text(json.dumps({"agent_version": "0.1.0", "files": []}))
    _, token = enrollment_token_issue(
        account_id=ids.account_id(AccountFactory().id), label="w", now=timezone.now()
    )
    body = client.get(f"/join/{token}/manifest.json?platform={key}&abi=cp312").json()
    (listed,) = body["bundles"]
    f = m["files"][0]
    assert listed == {
        "platform": key, "machine": arch, "glibc": "2.36", "agent_version": "0.1.0",
        "agent_source": join.agent_source_hash(), "name": f["name"], "size": f["size"],
        "sha256": f["sha256"],
    }  # fmt: skip
    assert all(s["abi"] != key for s in body.get("served", []))


def test_a_failed_bundle_build_is_retried_after_a_pause_not_in_a_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """A controller whose first build failed (two builds once clobbered a shared venv) builds
    again once the failure is RETRY_AFTER_SECONDS old, without a restart."""
    runs = tmp_path / "runs"
    builder = tmp_path / "build-bundle.sh"
    builder.write_text(f"#!/bin/sh\necho run >> {runs}\nexit 1\n")
    builder.chmod(0o755)
    settings.VAR_DIR = tmp_path / "var"
    monkeypatch.setattr(bundles, "BUILDER", builder)
    monkeypatch.setattr(bundles, "_build", {})
    monkeypatch.setattr(bundles, "_build_failed_at", {})
    assert bundles.start_build() is True
    bundles._build["proc"].wait(timeout=30)
    assert bundles.start_build() is False  # failed just now: not again at once
    assert bundles.start_build() is False
    assert runs.read_text().count("run") == 1
    monkeypatch.setattr(bundles, "RETRY_AFTER_SECONDS", 0.0)
    assert bundles.start_build() is True  # the pause is over: one more try
    bundles._build["proc"].wait(timeout=30)
    assert runs.read_text().count("run") == 2
