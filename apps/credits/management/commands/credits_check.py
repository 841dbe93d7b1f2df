"""`manage.py credits_check`: prove the ledger (exit 1 on any mismatch)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.credits.ledger import ledger_verify


class Command(BaseCommand):
    help = "Verify the credit ledger: entries sum to zero, cached balances equal the replay, floors hold."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the full report as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        report = ledger_verify()
        if options["json"]:
            self.stdout.write(
                json.dumps({**asdict(report), "ok": report.ok}, indent=2, default=str)
            )
        else:
            self.stdout.write(
                f"{report.entries} entries, {report.postings} postings, {report.accounts} accounts; "
                f"total minted {report.total_minted} micro-credits"
            )
            for row in report.unbalanced_entries:
                self.stderr.write(
                    f"UNBALANCED entry {row['entry_id']}: postings sum to {row['sum']}"
                )
            for row in report.balance_mismatches:
                self.stderr.write(
                    f"MISMATCH {row['name']} ({row['account_id']}): cached {row['cached']} != replay {row['replayed']}"
                )
            for row in report.below_floor:
                self.stderr.write(
                    f"BELOW FLOOR {row['name']}: balance {row['balance']} < floor {row['floor']}"
                )
            if report.holds_mismatch:
                self.stderr.write(f"HOLDS {report.holds_mismatch}")
        if not report.ok:
            raise CommandError("ledger check FAILED")
        if not options["json"]:
            self.stdout.write(self.style.SUCCESS("ledger OK"))
