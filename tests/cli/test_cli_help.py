"""`racon --help` lists every command; each command's --help has an example; a usage error is
one line naming the closest valid command or option (issue 26). The console script, run for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from racon_cli.examples import EXAMPLES, add_examples, walk
from racon_cli.main import app

RACON = str(Path(sys.executable).parent / "racon")


def racon(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "200", "RACON_CONFIG": "/nonexistent/c.json"}
    return subprocess.run([RACON, *args], capture_output=True, text=True, timeout=60, env=env)


def test_racon_help_lists_every_command_with_one_line() -> None:
    out = racon("--help")
    assert out.returncode == 0, out.stderr
    root = typer.main.get_command(app)
    for name in root.commands:  # type: ignore[attr-defined]
        rows = [ln for ln in out.stdout.splitlines() if ln.strip("│ ").startswith(name + " ")]
        assert rows, (name, out.stdout)
    assert "bundle" in root.commands  # type: ignore[attr-defined]


def test_every_commands_help_ends_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    command = add_examples(app)  # what main() runs (in-process here: 40 commands)
    leaves = walk(command)
    assert len(leaves) > 30
    for path, _ in leaves:
        code = command.main([*path.split(), "--help"], prog_name="racon", standalone_mode=False)
        help_text = " ".join(capsys.readouterr().out.split())
        assert code == 0
        assert f"Example: racon {path}" in help_text, (path, help_text[-400:])
    # The hand-written ones name real commands (a renamed command is caught here).
    assert set(EXAMPLES) <= {p for p, _ in leaves}


def test_an_unknown_command_is_one_line_naming_the_closest() -> None:
    out = racon("nods", "ls")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "racon: error: No such command 'nods'. Did you mean 'nodes', 'models'? "
        "(`racon --help` lists them)"
    ]


def test_an_unknown_option_is_one_line_naming_the_closest() -> None:
    out = racon("tokens", "create", "desk", "--max-use", "2")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("racon tokens create: error: No such option: --max-use")
    assert "--max-uses" in lines[0]
