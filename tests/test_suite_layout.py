"""The suite's own rule (issue 29): no test module imports another test module or a conftest.py.

Shared fixtures live in conftest.py files, and shared helpers in non-test modules (tests/support/,
a directory's harness.py or helpers.py), so that a test module can be moved, renamed or run alone
without breaking another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    package = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            if not base.startswith("tests"):
                continue
            out.append((node.lineno, base))
            # `from tests.x import test_y`: the names may be modules themselves.
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def test_no_test_module_imports_another_test_module_or_a_conftest() -> None:
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        for lineno, module in _imported_modules(path):
            if not module.startswith("tests.") or not _is_test_module(module):
                continue
            target = TESTS.parent / (module.replace(".", "/") + ".py")
            rel = str(path.relative_to(TESTS.parent))
            if target.exists() and target != path:
                offences.append(f"{rel}:{lineno} imports {module}")
    assert offences == [], "\n".join(offences)
