"""`racon bundle ...`: the standalone agent bundle the join line installs (no Python needed).

`build` runs scripts/build-bundle.sh of this checkout (PyInstaller, in a build-only venv) for this
machine's platform; `upload` hands a bundle built elsewhere to the controller, which then serves
it to joining machines of that platform; `ls` lists what the controller serves.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from .. import render
from ..client import EXIT_CONFIG, ApiError
from .common import JsonOpt, client, handled, out

app = typer.Typer(
    help="The standalone agent bundle: build one here, upload it, list what is served.",
    no_args_is_help=True,
)
BUILDER = Path(__file__).resolve().parents[2] / "scripts" / "build-bundle.sh"


@app.command("build")
@handled
def bundle_build(
    force: Annotated[bool, typer.Option("--force", help="Rebuild even when cached.")] = False,
    publish: Annotated[
        bool,
        typer.Option(
            "--publish/--no-publish",
            help="Also place it where a controller on this machine serves it.",
        ),
    ] = True,
) -> None:
    """Build the agent bundle for this machine's platform (prints its tarball's path)."""
    if not BUILDER.is_file():
        raise ApiError(
            f"{BUILDER} not found: `racon bundle build` runs from a RACoN checkout "
            "(git clone, then make install)",
            exit_code=EXIT_CONFIG,
        )
    env = dict(os.environ)
    if not publish:
        env["RACON_BUNDLE_PUBLISH"] = "none"
    proc = subprocess.run(
        [str(BUILDER), *(["--force"] if force else [])],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ApiError("building the bundle failed (see the lines above)", exit_code=EXIT_CONFIG)
    path = proc.stdout.strip().splitlines()[-1]
    out().print(f"bundle: {path}")
    out().print(f"upload it to a controller of another platform: racon bundle upload {path}")


@app.command("upload")
@handled
def bundle_upload(
    file: Annotated[Path, typer.Argument(help="The tarball `racon bundle build` printed.")],
    as_json: JsonOpt = False,
) -> None:
    """Upload a bundle built on another platform; the controller serves it to that platform."""
    if not file.is_file():
        raise ApiError(f"{file}: no such file", exit_code=EXIT_CONFIG)
    with client(timeout=600) as c:
        resp = c.request(
            "POST",
            "/api/admin/bundles",
            params={"name": file.name},
            content=file.read_bytes(),
            headers={"Content-Type": "application/gzip"},
            what="upload",
        )
    m = resp.json()
    if as_json:
        return render.emit_json(m)
    f = m["files"][0]
    out().print(
        f"Uploaded {f['name']} ({render.human_bytes(f['size'])}) for {m['platform']} "
        f"(glibc >= {m['glibc']}); joining machines of that platform get it now."
    )


@app.command("ls")
@handled
def bundle_ls(as_json: JsonOpt = False) -> None:
    """List the agent bundles the controller serves (platform, size, glibc floor)."""
    with client() as c:
        rows = c.get("/api/admin/bundles")
    if as_json:
        return render.emit_json(rows)
    t = render.table("PLATFORM", "MACHINE", "GLIBC", "AGENT", "SIZE", "SHA256")
    for b in rows:
        t.add_row(
            b["platform"],
            b["machine"],
            f">= {b['glibc']}",
            b["agent_version"],
            render.human_bytes(b["size"]),
            b["sha256"][:12],
        )
    out().print(
        t if rows else "No bundles: run `racon bundle build` on a machine of each platform."
    )
