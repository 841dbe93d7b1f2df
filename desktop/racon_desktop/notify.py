"""The desktop notifications the owner can switch off (issue 31): the node went OFFLINE, a
challenge failed, a pause finished handing work off, the daily earnings.

What fires is decided here, from what the poller sees (the tray's state before and after, the
node as /api/agent/self has it); sending is the caller's (the Tauri notification plugin, a
freedesktop notification over D-Bus on Linux). The switches live in the app's own settings file,
``$XDG_CONFIG_HOME/racon-desktop/settings.json`` (default ``~/.config``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from datetime import date, timedelta
from pathlib import Path
from typing import Any

KINDS = {
    "offline": "the node went OFFLINE",
    "challenge": "a challenge failed",
    "paused": "a pause finished handing work off",
    "earnings": "the daily earnings",
}
ONLINE = ("READY", "BUSY", "DRAINING", "PAUSED")
log = logging.getLogger("racon_desktop.notify")


def settings_path(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "racon-desktop" / "settings.json"


class Notifier:
    def __init__(self, path: Path, send: Callable[[str, str], None]) -> None:
        self.path = path
        self.send = send
        self.lock = threading.Lock()
        self.sent: list[dict[str, str]] = []  # what fired, newest last (the window lists them)
        self.challenge_seen: str | None = None
        self.raw_before = ""  # the controller's state for the node at the last poll

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def switches(self) -> dict[str, bool]:
        """Every kind on unless the owner switched it off."""
        saved = self._read().get("notify") or {}
        return {k: bool(saved.get(k, True)) for k in KINDS}

    def set_switches(self, values: Mapping[str, bool]) -> dict[str, bool]:
        with self.lock:
            data = self._read()
            data["notify"] = {k: bool(values.get(k, True)) for k in KINDS}
            self._write(data)
        return self.switches()

    def fire(self, kind: str, title: str, body: str) -> bool:
        if not self.switches().get(kind, False):
            log.info("notification %s switched off: %s", kind, title)
            return False
        try:
            self.send(title, body)
        except Exception:  # a notification daemon's failure must not stop the poller
            log.exception("notification %s could not be shown", kind)
            return False
        with self.lock:
            self.sent.append({"kind": kind, "title": title, "body": body})
            del self.sent[:-20]
        return True

    def observe(self, before: str, after: str, node: Mapping[str, Any] | None, error: str) -> None:
        """One poll's transitions: OFFLINE, a pause handed off, a new failed challenge."""
        name = str((node or {}).get("name") or "this machine")
        if after == "OFFLINE" and before in ONLINE:
            why = error or "the controller has the node OFFLINE"
            self.fire("offline", f"RACoN: {name} is OFFLINE", why)
        # The drain is done when the controller has the node DRAINED (DRAINING → DRAINED; a poll
        # may miss a short DRAINING): once per drain, not at start.
        raw = str((node or {}).get("state") or "") if node is not None else self.raw_before
        if raw == "DRAINED" and self.raw_before not in ("", "DRAINED"):
            self.fire(
                "paused",
                f"RACoN: {name} paused",
                "Lending is paused: the running work was handed off."
                if (node or {}).get("paused")
                else "The node is drained: its running work was handed off.",
            )
        self.raw_before = raw
        failed = (node or {}).get("last_challenge_failure")
        if isinstance(failed, dict) and failed.get("id") is not None:
            seen, self.challenge_seen = self.challenge_seen, str(failed["id"])
            if seen is not None and seen != self.challenge_seen:
                self.fire(
                    "challenge",
                    f"RACoN: {name} failed a challenge",
                    str(failed.get("message") or failed.get("kind") or "a challenge failed"),
                )
        elif node is not None and self.challenge_seen is None:
            self.challenge_seen = ""

    def daily(self, today: date, earnings: Callable[[], list[dict[str, Any]]]) -> None:
        """Once a day: yesterday's credits and jobs (the first day only records the date)."""
        data = self._read()
        last = data.get("earnings_day")
        if last == today.isoformat():
            return
        with self.lock:
            data = self._read()
            data["earnings_day"] = today.isoformat()
            self._write(data)
        if last is None:
            return
        yesterday = (today - timedelta(days=1)).isoformat()
        rows = [r for r in earnings() if str(r.get("day")) == yesterday]
        credits = sum(int(r["credits"]) for r in rows)
        jobs = sum(int(r["jobs"]) for r in rows)
        self.fire(
            "earnings",
            f"RACoN: {credits / 1e6:.6f} credits yesterday",
            f"{jobs} jobs served on {yesterday}.",
        )
