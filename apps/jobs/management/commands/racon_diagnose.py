"""`manage.py racon_diagnose NODE [--out FILE]`: write a node's diagnostics bundle, print its summary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from apps.jobs.diagnostics import UnknownNode, node_diagnostics, node_resolve
from racon import ids


class Command(BaseCommand):
    help = (
        "Write a tar.gz with a node's versions, state history, events, hardware, last errors, recent jobs "
        "(failed before or during execution) and reachability, and print a summary. Holds no secrets."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("node", help="node name or id")
        parser.add_argument(
            "--out",
            default="",
            help="file to write (default: ./racon-diagnose-<name>-<time>.tar.gz)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        now = timezone.now()
        try:
            node = node_resolve(ref=opts["node"])
            diag = node_diagnostics(node_id=ids.node_id(node.id), now=now)
        except UnknownNode as exc:
            raise CommandError(str(exc)) from None
        out = Path(
            opts["out"]
            or f"racon-diagnose-{_safe(diag.node_name)}-{now.strftime('%Y%m%dT%H%M%SZ')}.tar.gz"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        # 0600: the bundle names addresses and errors, only whoever asked for it should read it.
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(diag.data)
        self.stdout.write(diag.summary.rstrip("\n"))
        self.stdout.write(f"bundle written to {out} ({len(diag.data)} bytes)")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60] or "node"
