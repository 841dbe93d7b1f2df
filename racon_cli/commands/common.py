"""What every command shares: the global options, the error contract and the API client factory."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from .. import render
from ..client import EXIT_CONFIG, ApiError, Client
from ..config import ConfigError, Settings, load

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")]


class GlobalOptions:
    """--url, --key and --config, set by the root callback before any command runs."""

    url: str | None = None
    key: str | None = None
    config: Path | None = None


G = GlobalOptions()

out = render.console


def handled[**P, R](fn: Callable[P, R]) -> Callable[P, R]:
    """Turn every failure into one line on stderr and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except ApiError as exc:
            render.err(exc.message)
            raise typer.Exit(exc.exit_code) from None
        except ConfigError as exc:
            render.err(str(exc))
            raise typer.Exit(EXIT_CONFIG) from None
        except KeyboardInterrupt:
            render.err("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def settings() -> Settings:
    """The controller URL and key: flags, then the environment, then the config file."""
    return load(G.config, url=G.url, key=G.key)


def connect(url: str, key: str, *, timeout: float = 30.0) -> Client:
    # The one place a Client is made: the offline tests swap `Client` here for a mock transport.
    return Client(url, key, timeout=timeout)


def client(timeout: float = 30.0) -> Client:
    s = settings()
    if not s.key:
        raise ApiError(
            "no API key: run `racon login --url URL --key KEY` or set RACON_API_KEY",
            exit_code=EXIT_CONFIG,
        )
    return connect(s.url, s.key, timeout=timeout)
