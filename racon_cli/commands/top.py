"""`racon top`: the live terminal view (textual), started only when asked for."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import connect, handled, settings


@handled
def top(interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0) -> None:
    """Live view of nodes, deployments, jobs and events (d drain, u undrain, c cancel job, q quit)."""
    s = settings()
    connect(s.url, s.key).close()  # validate the URL before the screen takes over
    # textual takes about half a second to import and only `racon top` needs it: every other
    # command starts without it.
    from ..top import TopApp  # noqa: PLC0415

    TopApp(url=s.url, key=s.key, interval=interval).run()
