"""RACoN's desktop app (issue 31): ``racon-desktop``, a Tauri tray app through pytauri-wheel."""

from __future__ import annotations
