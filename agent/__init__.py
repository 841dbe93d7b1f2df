"""RACoN node agent: turns a machine into a node of the pool. Never imports Django."""

from __future__ import annotations

__version__ = "0.1.0"
