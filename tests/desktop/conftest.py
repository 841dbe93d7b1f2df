from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

import pytest

from tests.support.unavailable import unavailable

TOOLS = (
    "xvfb-run",
    "dbus-run-session",
    "dbus-monitor",
    "dunst",
    "WebKitWebDriver",
    "gdbus",
    "import",
)
LIBS = ("libwebkit2gtk-4.1.so.0", "libayatana-appindicator3.so.1")


def desktop_missing() -> str | None:
    """What the desktop tests lack on this machine (None: nothing)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    for lib in LIBS:
        if not any(
            os.path.exists(os.path.join(d, lib))
            for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib")
        ):
            missing.append(lib)
    if importlib.util.find_spec("pytauri_wheel") is None:
        missing.append("pytauri-wheel (the 'desktop' extra: make install)")
    return ", ".join(missing) if missing else None


@pytest.fixture(scope="session")
def desktop_ready() -> None:
    missing = desktop_missing()
    if missing is None:
        return
    unavailable(
        f"the desktop app's packages are missing ({missing}): scripts/install-desktop.sh",
        under_ci="must install them under CI (make test runs it as root with apt)",
    )


@pytest.fixture(scope="session")
def live(
    django_db_setup: None,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Any:
    """The suite's shared live controller (tests/cli/live.py)."""
    from tests.cli.live import shared_controller

    return shared_controller(request, django_db_blocker, tmp_path_factory)
