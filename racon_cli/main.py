"""`racon`: run a RACoN cluster from the terminal. A client of the controller's REST API only.

Exit codes: 0 ok, 1 the controller refused (4xx/5xx, the line says which), 2 bad usage,
3 controller unreachable, 4 not configured or a local file problem.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from typer._click.exceptions import UsageError  # typer's own click, which it raises

from .commands import (
    accounts,
    bundle,
    chat,
    common,
    credits,
    deployments,
    jobs,
    keys,
    models,
    nodes,
    session,
    tokens,
    top,
)

app = typer.Typer(
    help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False
)
app.add_typer(nodes.app, name="nodes")
app.add_typer(tokens.app, name="tokens")
app.add_typer(models.app, name="models")
app.add_typer(deployments.app, name="deployments")
app.add_typer(jobs.app, name="jobs")
app.add_typer(credits.app, name="credits")
app.add_typer(accounts.app, name="accounts")
app.add_typer(keys.app, name="keys")
app.add_typer(bundle.app, name="bundle")
# Top-level commands, in the order `racon --help` lists them.
for command in (
    session.login,
    session.version,
    nodes.diagnose,
    deployments.deploy,
    chat.chat,
    top.top,
):
    app.command()(command)


@app.callback()
def _root(
    url: Annotated[
        str | None,
        typer.Option("--url", help="Controller URL (default: RACON_URL, then the config file)."),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option("--key", help="API key (default: RACON_API_KEY, then the config file)."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="Config file (default: ~/.config/racon/config.json)."),
    ] = None,
) -> None:
    common.G.url, common.G.key, common.G.config = url, key, config


def main() -> None:
    """`racon`: every command's --help ends with an example; a usage error is one line."""
    from .examples import add_examples, one_line  # noqa: PLC0415 - only the console script

    command = add_examples(app)
    try:
        code = command.main(prog_name="racon", standalone_mode=False)
    except UsageError as exc:
        print(one_line(exc), file=sys.stderr)
        raise SystemExit(2) from None
    except typer.Abort:
        print("racon: aborted", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
