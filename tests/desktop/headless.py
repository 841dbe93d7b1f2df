"""A headless desktop for racon-desktop's live tests: Xvfb (xvfb-run), a D-Bus session
(dbus-run-session), dunst as the notification daemon, dbus-monitor recording every
org.freedesktop.Notifications.Notify call on that bus, and Debian's WebKitWebDriver, which starts
the app (TAURI_WEBVIEW_AUTOMATION=true) with the environment given here. Killed as one process
group after."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import BIN, free_port, wait_for


class WebDriver:
    """The few W3C WebDriver calls the tests need."""

    def __init__(self, base: str, session: str) -> None:
        self.base, self.session = base, session

    def _url(self, path: str) -> str:
        return f"{self.base}/session/{self.session}{path}"

    def run(self, script: str) -> Any:
        resp = httpx.post(
            self._url("/execute/sync"), json={"script": script, "args": []}, timeout=30
        )
        resp.raise_for_status()
        return resp.json()["value"]

    def text(self, css: str) -> str:
        return str(
            self.run(f"const e = document.querySelector({css!r}); return e ? e.textContent : ''")
        )

    def title(self) -> str:
        return str(httpx.get(self._url("/title"), timeout=30).json()["value"])

    def url(self) -> str:
        return str(self.run("return window.location.href"))


@dataclass
class Desktop:
    env: dict[str, str]  # the session's: DISPLAY, DBUS_SESSION_BUS_ADDRESS, XAUTHORITY
    driver: str  # WebKitWebDriver's URL
    notes: Path  # dbus-monitor's record of Notify calls
    session: str = ""

    def start_app(self, *args: str) -> WebDriver:
        """racon-desktop ARGS, started by the driver (a new session)."""
        created = httpx.post(
            self.driver + "/session",
            json={"capabilities": {"alwaysMatch": {"webkitgtk:browserOptions": {
                "binary": str(BIN / "racon-desktop"), "args": list(args),
            }}}},
            timeout=120,
        )  # fmt: skip
        assert created.status_code == 200, created.text
        self.session = created.json()["value"]["sessionId"]
        return WebDriver(self.driver, self.session)

    def stop_app(self) -> None:
        if self.session:
            httpx.delete(f"{self.driver}/session/{self.session}", timeout=30)
            self.session = ""

    def notifications(self) -> list[str]:
        """The summaries of the notifications sent on this session bus, in order."""
        out, lines = [], self.notes.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "member=Notify" in line:
                # Notify(app_name, replaces_id, app_icon, summary, body, ...): the 3rd string.
                strings = [
                    ln.strip() for ln in lines[i + 1 : i + 12] if ln.strip().startswith("string ")
                ]
                if len(strings) >= 3:
                    out.append(strings[2][len('string "') : -1])
        return out

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shot = subprocess.run(
            ["import", "-window", "root", "-crop", "980x760+0+0", "+repage", str(path)],
            env=self.env, capture_output=True, timeout=60,
        )  # fmt: skip
        assert shot.returncode == 0, shot.stderr


@contextmanager
def desktop(tmp_path: Path, **extra: str) -> Iterator[Desktop]:
    """The headless session; ``extra`` goes into the environment the app is started with (and
    XDG_CONFIG_HOME is the test's, so the notification switches are too)."""
    envfile = tmp_path / "display.env"
    notes = tmp_path / "notifications.log"
    port = free_port()
    env = {
        **os.environ,
        "TAURI_WEBVIEW_AUTOMATION": "true",
        "GDK_BACKEND": "x11",
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        **extra,
    }
    script = (
        f'printf "%s\\n%s\\n%s\\n" "$DISPLAY" "$DBUS_SESSION_BUS_ADDRESS" "$XAUTHORITY" > {envfile}; '
        f"dunst > {tmp_path / 'dunst.log'} 2>&1 & "
        f"dbus-monitor --session \"interface='org.freedesktop.Notifications',member='Notify'\" "
        f"> {notes} 2>&1 & "
        f"exec WebKitWebDriver --port={port}"
    )
    proc = subprocess.Popen(
        ["xvfb-run", "-a", "-s", "-screen 0 1280x900x24", "dbus-run-session", "--",
         "bash", "-c", script],
        env=env, stdout=open(tmp_path / "display.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    d = None
    try:
        wait_for(lambda: envfile.exists() and len(envfile.read_text().splitlines()) == 3, 60,
                 "Xvfb and the D-Bus session")  # fmt: skip
        disp, bus, xauth = envfile.read_text().splitlines()
        base = f"http://127.0.0.1:{port}"

        def driver_up() -> bool:
            try:
                return httpx.get(base + "/status", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(driver_up, 60, "WebKitWebDriver")
        wait_for(notes.exists, 30, "dbus-monitor")
        d = Desktop(
            env={**env, "DISPLAY": disp, "DBUS_SESSION_BUS_ADDRESS": bus, "XAUTHORITY": xauth},
            driver=base,
            notes=notes,
        )
        yield d
    finally:
        if d is not None:
            try:
                d.stop_app()
            except httpx.HTTPError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0)
