"""The `racon` commands, one module per group; `racon_cli.main` wires them into the root app."""

from __future__ import annotations
