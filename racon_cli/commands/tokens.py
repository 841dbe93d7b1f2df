"""`racon tokens ...`: enrollment tokens for new nodes."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from .. import render
from .common import JsonOpt, client, handled, out

app = typer.Typer(help="Enrollment tokens for new nodes.", no_args_is_help=True)


@app.command("create")
@handled
def tokens_create(
    label: Annotated[str, typer.Argument(help="What the token is for, e.g. the machine's name.")],
    ttl_hours: Annotated[
        int | None, typer.Option(help="Hours until it expires (server default: 24).")
    ] = None,
    max_uses: Annotated[int, typer.Option(help="Machines that may enroll with it.")] = 1,
    account: Annotated[
        str | None,
        typer.Option(
            help="Account that will own the nodes: name, username or id (default: yours)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an enrollment token; prints the one join line (shown once)."""
    body: dict[str, Any] = {"label": label, "max_uses": max_uses}
    if ttl_hours is not None:
        body["ttl_hours"] = ttl_hours
    with client() as c:
        if account:
            body["account"] = c.account_id(account)
        tok = c.post("/api/admin/tokens", body)
    if as_json:
        return render.emit_json(tok)
    con = out()
    con.print(
        f"Token {tok['label']!r} ({tok['prefix']}…) expires {render.when(tok['expires_at'])}, {tok['max_uses']} use(s)."
    )
    con.print(
        "Paste this one line on the machine to enroll it (it needs only sh and curl; the token "
        "is not shown again):"
    )
    # Printed raw (no markup, no wrapping) so each copies as one line.
    sys.stdout.write(tok.get("join_command", tok["command"]) + "\n")
    if "join_python_command" in tok:
        con.print("Without curl:")
        sys.stdout.write(tok["join_python_command"] + "\n")
        con.print("With the agent already installed:")
        sys.stdout.write(tok["command"] + "\n")


@app.command("ls")
@handled
def tokens_ls(as_json: JsonOpt = False) -> None:
    """List enrollment tokens (never their secrets)."""
    with client() as c:
        toks = c.get("/api/admin/tokens")
    if as_json:
        return render.emit_json(toks)
    t = render.table("ID", "LABEL", "PREFIX", "STATUS", "USES", "EXPIRES")
    for tok in toks:
        t.add_row(
            render.short_id(tok["id"]),
            tok["label"],
            tok["prefix"] + "…",
            render.state(tok["status"]),
            f"{tok['uses']}/{tok['max_uses']}",
            render.when(tok["expires_at"]),
        )
    out().print(t if toks else "No tokens.")


@app.command("revoke")
@handled
def tokens_revoke(
    token: Annotated[
        str,
        typer.Argument(
            help="Token label, id (or a unique prefix of it), or the token's own prefix (rcn_…)."
        ),
    ],
    as_json: JsonOpt = False,
) -> None:
    """Revoke an enrollment token."""
    with client() as c:
        toks = c.get("/api/admin/tokens")
        by_secret_prefix = [
            t
            for t in toks
            if token.startswith("rcn_")
            and (t["prefix"].startswith(token) or token.startswith(t["prefix"]))
        ]
        tok = (
            by_secret_prefix[0]
            if len(by_secret_prefix) == 1
            else c.by_ref(toks, token, "token", ("label",))
        )
        after = c.post(f"/api/admin/tokens/{tok['id']}/revoke")
    if as_json:
        return render.emit_json(after)
    out().print(f"Revoked token {after['label']!r} ({after['prefix']}…).")
