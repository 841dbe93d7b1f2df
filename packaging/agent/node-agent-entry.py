"""PyInstaller's entry script for the bundle: everything is in agent/bundle_main.py."""

from __future__ import annotations

from agent.bundle_main import main

main()
