"""`racon`: the command-line client of a RACoN controller (REST API only; never imports Django)."""

from __future__ import annotations

__version__ = "0.1.0"
