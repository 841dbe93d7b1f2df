"""`manage.py racon_tls show|rotate [--ca]`: the LAN controller's CA, server key and join pin.

`show` prints the pin the join lines carry and the certificates' dates. `rotate` makes a new
server key (new join lines carry a new pin; joined agents keep working, they check the CA);
`rotate --ca` makes a new CA as well, and every joined machine must re-pin. The launcher issues
the certificates again on its next start (racon/tls.py). Stop `make run` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from racon import tls


class Command(BaseCommand):
    help = "Show or rotate the LAN controller's TLS keys (the join pin)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("action", choices=("show", "rotate"))
        parser.add_argument("--ca", action="store_true", help="rotate the CA's key too")

    def handle(self, *args: Any, **opts: Any) -> None:
        var = Path(settings.VAR_DIR)
        d = tls.tls_dir(var)
        if opts["action"] == "show":
            cert = d / "server.crt"
            if not cert.is_file():
                raise CommandError(
                    f"no server certificate in {d}: start `BIND=<address> make run` once"
                )
            self.stdout.write(f"join pin: {tls.spki_pin(cert)}")
            self.stdout.write(f"CA: {d / 'ca.crt'}")
            return
        done = tls.rotate(var_dir=var, ca_too=opts["ca"])
        if not done:
            raise CommandError(f"nothing to rotate in {d}")
        for line in done:
            self.stdout.write(f"moved {line}")
        self.stdout.write(
            "New keys are made at the next `BIND=<address> make run`; the join lines it gives carry "
            "the new pin (issue new tokens: old lines carry the old pin)."
        )
        if opts["ca"]:
            self.stdout.write(
                "The CA changed: every joined machine must re-pin. On each, run a new join line "
                "(`racon tokens create <name>`): it keeps the node and hands the agent the new CA."
            )
        else:
            self.stdout.write(
                "Joined agents need nothing: they check the controller against its CA."
            )
