"""`racon accounts ...`: contributor accounts (operators only)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .. import render
from .common import JsonOpt, client, handled, out

app = typer.Typer(help="Contributor accounts (operators only).", no_args_is_help=True)


@app.command("create")
@handled
def accounts_create(
    username: Annotated[str, typer.Argument(help="The contributor's sign-in name.")],
    email: Annotated[str, typer.Option(help="Their email address.")] = "",
    password: Annotated[
        str | None,
        typer.Option(help="Set this password (default: none, an invite link is printed instead)."),
    ] = None,
    staff: Annotated[bool, typer.Option("--staff", help="Make them an operator.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create an account with its starting grant; without --password, print a one-time invite link."""
    body: dict[str, Any] = {"username": username, "email": email, "is_staff": staff}
    if password:
        body["password"] = password
    with client() as c:
        acct = c.post("/api/admin/accounts", body)
    _created(acct, as_json)


@app.command("invite")
@handled
def accounts_invite(
    username: Annotated[
        str,
        typer.Argument(help="A new user to invite, or an invited one whose link to issue again."),
    ],
    email: Annotated[str, typer.Option(help="Their email address (new users).")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Invite a contributor: prints a one-time link to set their password (shown once)."""
    with client() as c:
        existing = [a for a in c.get("/api/admin/accounts") if a.get("username") == username]
        if existing:
            link = c.post(f"/api/admin/accounts/{existing[0]['id']}/invite")
            acct = {**existing[0], "invite_url": link["invite_url"]}
        else:
            acct = c.post("/api/admin/accounts", {"username": username, "email": email})
    _created(acct, as_json)


def _created(acct: dict[str, Any], as_json: bool) -> None:
    if as_json:
        return render.emit_json(acct)
    con = out()
    con.print(
        f"Account {acct['name']!r} ({render.short_id(acct['id'])}), balance {render.credits(acct['balance'])}."
    )
    if acct.get("invite_url"):
        con.print("Send this one-time link to set the password:")
        typer.echo(acct["invite_url"])


@app.command("ls")
@handled
def accounts_ls(as_json: JsonOpt = False) -> None:
    """List contributor accounts."""
    with client() as c:
        accts = c.get("/api/admin/accounts")
    if as_json:
        return render.emit_json(accts)
    t = render.table("ID", "NAME", "USER", "STATUS", "BALANCE", "KEYS", "CREATED")
    for a in accts:
        t.add_row(
            render.short_id(a["id"]),
            a["name"],
            (a.get("username") or "-") + (" (operator)" if a.get("is_staff") else ""),
            "invited" if a.get("invite_pending") else "active",
            render.credits(a["balance"]),
            str(a.get("active_keys", 0)),
            render.when(a["created_at"]),
        )
    out().print(t if accts else "No accounts.")


# `racon accounts list` reads as well as `ls`.
app.command("list", hidden=True)(accounts_ls)
