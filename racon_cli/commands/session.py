"""`racon login` and `racon version`."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from ..client import ApiError
from ..config import default_config_path, save
from .common import G, connect, handled, out


@handled
def login(
    url: Annotated[str, typer.Option("--url", help="Controller URL, e.g. http://10.0.0.2:8000")],
    key: Annotated[
        str, typer.Option("--key", help="API key (the operator's AI_API_KEY or a per-account key)")
    ],
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Check the URL and key before saving.")
    ] = True,
) -> None:
    """Store the controller URL and API key (config file, mode 0600)."""
    note = ""
    if verify:
        with connect(url, key) as c:
            c.get(
                "/api/credits/balance"
            )  # any valid key may read its own balance: proves URL and key
            try:
                c.get("/api/admin/nodes", params={"state": "READY"})
            except ApiError as exc:
                if exc.status != 403:
                    raise
                note = " (not an operator key: admin commands will be refused)"
    path = G.config or default_config_path()
    save(path, url=url, key=key)
    out().print(f"Logged in to {url.rstrip('/')}{note}; saved to {path}")


def version() -> None:
    """Print the CLI version."""
    out().print(f"racon {__version__}")
