"""The CLI tests' shared shapes: the in-process runner's type and the CLI's error contract."""

from __future__ import annotations

from collections.abc import Callable

from typer.testing import Result

Run = Callable[..., Result]


def one_error_line(result: Result) -> str:
    """The CLI's error contract: a non-zero exit and exactly one line on stderr, starting 'error: '."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code != 0, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]
