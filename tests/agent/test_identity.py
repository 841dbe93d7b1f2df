from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.identity import Identity, IdentityError, load_identity, machine_id, save_identity


def test_saved_identity_is_mode_0600_and_round_trips(tmp_path: Path) -> None:
    ident = Identity("node-1", "s3cret", "http://127.0.0.1:8000", "redis://127.0.0.1:6379/0", "box")
    path = save_identity(tmp_path / "state", ident)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    loaded = load_identity(tmp_path / "state")
    assert loaded == ident
    assert loaded is not None and loaded.auth_header() == "Node node-1:s3cret"


def test_overwriting_keeps_mode_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ident = Identity("n", "c", "http://x:1", "redis://x/0")
        save_identity(tmp_path, ident)
        path = save_identity(tmp_path, Identity("n", "c2", "http://x:1", "redis://x/0"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_identity(tmp_path).credential == "c2"


def test_missing_identity_is_none_and_corrupt_identity_is_an_error(tmp_path: Path) -> None:
    assert load_identity(tmp_path) is None
    (tmp_path / "identity.json").write_text("{not json")
    with pytest.raises(IdentityError):
        load_identity(tmp_path)


def test_machine_id_is_stable_per_state_dir_and_distinct_across_state_dirs(tmp_path: Path) -> None:
    etc = tmp_path / "machine-id"
    etc.write_text("0123456789abcdef0123456789abcdef\n")
    a1 = machine_id(tmp_path / "a", etc_machine_id=etc)
    a2 = machine_id(tmp_path / "a", etc_machine_id=etc)
    b = machine_id(tmp_path / "b", etc_machine_id=etc)
    assert a1 == a2
    assert a1 != b
    # Without /etc/machine-id a random id is generated, then persisted.
    c1 = machine_id(tmp_path / "c", etc_machine_id=tmp_path / "absent")
    assert c1 == machine_id(tmp_path / "c", etc_machine_id=tmp_path / "absent")
    assert len(c1) == 32
