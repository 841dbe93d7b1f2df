"""`manage.py rollup_flush`: write the charts' per-minute rollup now (the current minute included)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from apps.jobs.rollup import rollup_write


class Command(BaseCommand):
    help = (
        "Roll finished jobs and node telemetry into the per-minute rows the web UI's charts read, "
        "up to and including the current minute, without waiting for beat; prints the row counts."
    )

    def handle(self, *args: Any, **opts: Any) -> None:
        self.stdout.write(json.dumps(rollup_write(now=timezone.now())))
