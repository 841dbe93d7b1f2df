"""`racon keys ...`: your API keys for apps and agents, and what each has used."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import typer

from .. import render
from .common import JsonOpt, client, handled, out

app = typer.Typer(help="Your API keys, and the usage charged to each.", no_args_is_help=True)


@app.command("create")
@handled
def keys_create(
    name: Annotated[str, typer.Argument(help="What the key is for, e.g. the app's name.")],
    scope: Annotated[
        list[str] | None,
        typer.Option(
            "--scope",
            help="inference, read, keys or admin; repeat for several (default: inference).",
        ),
    ] = None,
    expires_in_days: Annotated[
        int | None, typer.Option(help="Days until it expires (default: never).")
    ] = None,
    account: Annotated[
        str | None,
        typer.Option(
            help="Account to make it for: name, username or id (operators; default: yours)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an API key; prints its secret, which is shown once."""
    body: dict[str, Any] = {"name": name, "scopes": scope or ["inference"]}
    if expires_in_days is not None:
        body["expires_in_days"] = expires_in_days
    with client() as c:
        if account:
            body["account"] = c.account_id(account)
        key = c.post("/api/keys", body)
    if as_json:
        return render.emit_json(key)
    out().print(
        f"Key {key['name']!r} ({key['prefix']}…), scopes {', '.join(key['scopes'])}, "
        f"expires {render.when(key['expires_at']) if key['expires_at'] else 'never'}."
    )
    out().print("The secret (not shown again):")
    typer.echo(key["key"])


@app.command("ls")
@handled
def keys_ls(
    all_: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List your keys (never their secrets) with when each was last used and what it used."""
    with client() as c:
        keys = c.get("/api/keys", params={"all": "true"} if all_ else None)
        usage = {u["key"]: u for u in c.get("/api/credits/usage")}
    if as_json:
        return render.emit_json([{**k, "usage": usage.get(k["id"])} for k in keys])
    t = render.table(
        "ID", "NAME", "PREFIX", "SCOPES", "STATUS", "LAST USED", "EXPIRES", "TOKENS", "CREDITS"
    )
    for k in keys:
        u = usage.get(k["id"]) or {}
        t.add_row(
            render.short_id(k["id"]),
            k["name"],
            k["prefix"] + "…",
            ",".join(k["scopes"]),
            render.state(k["status"]),
            render.when(k["last_used_at"]) if k["last_used_at"] else "never",
            render.when(k["expires_at"]) if k["expires_at"] else "never",
            str(u.get("total_tokens", 0)),
            render.credits(u.get("credits", 0)),
        )
    out().print(t if keys else "No keys.")


app.command("list", hidden=True)(keys_ls)


@app.command("usage")
@handled
def keys_usage(as_json: JsonOpt = False) -> None:
    """Jobs, tokens and credits per key (revoked keys included)."""
    with client() as c:
        usage = c.get("/api/credits/usage")
    if as_json:
        return render.emit_json(usage)
    t = render.table("KEY", "NAME", "JOBS", "PROMPT", "COMPLETION", "CREDITS", "LAST USED")
    for u in usage:
        t.add_row(
            render.short_id(u["key"]),
            u["name"] + (" (revoked)" if u["revoked"] else ""),
            str(u["jobs"]),
            str(u["prompt_tokens"]),
            str(u["completion_tokens"]),
            render.credits(u["credits"]),
            render.when(u["last_used_at"]) if u["last_used_at"] else "never",
        )
    out().print(t if usage else "No keys.")


@app.command("revoke")
@handled
def keys_revoke(
    key: Annotated[
        str, typer.Argument(help="Key id (or a unique prefix of it), or its rk_ prefix.")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Revoke a key: apps using it get 401 from then on."""
    with client() as c:
        keys = c.get("/api/keys")
        by_secret = [
            k
            for k in keys
            if key.startswith("rk_")
            and (k["prefix"].startswith(key) or key.startswith(k["prefix"]))
        ]
        found = by_secret[0] if len(by_secret) == 1 else c.by_prefix(keys, key, "key")
        after = c.post(f"/api/keys/{found['id']}/revoke")
    if as_json:
        return render.emit_json(after)
    out().print(f"Revoked key {after['name']!r} ({after['prefix']}…).")


@app.command("limits")
@handled
def keys_limits(
    ref: Annotated[
        str,
        typer.Argument(help="Key id (or a unique prefix of it); with --account, an account id."),
    ],
    account: Annotated[
        bool, typer.Option("--account", help="REF is an account: limits over all its keys.")
    ] = False,
    rpm: Annotated[
        int | None, typer.Option("--rpm", help="Requests per minute (0: no limit).")
    ] = None,
    tpm: Annotated[
        int | None, typer.Option("--tpm", help="Tokens per minute, prompt bound + max_tokens.")
    ] = None,
    concurrent: Annotated[
        int | None, typer.Option("--concurrent", help="Requests at once, queued or running.")
    ] = None,
    default: Annotated[
        bool, typer.Option("--default", help="Clear the figures: the settings' defaults apply.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show or set (operators) a key's or an account's limits on /v1."""
    body: dict[str, Any] = {}
    if default:
        body = {"requests_per_minute": None, "tokens_per_minute": None, "max_concurrent": None}
    for field, value in (
        ("requests_per_minute", rpm),
        ("tokens_per_minute", tpm),
        ("max_concurrent", concurrent),
    ):
        if value is not None:
            body[field] = value
    with client() as c:
        if account:
            path = f"/api/admin/accounts/{ref}/limits"
        elif _is_uuid(ref):
            path = f"/api/admin/keys/{ref}/limits"  # any account's key, by its full id
        else:
            keys = c.get("/api/keys", params={"all": "true"})
            path = f"/api/admin/keys/{c.by_prefix(keys, ref, 'key')['id']}/limits"
        got = c.post(path, body) if body else c.get(path)
    if as_json:
        return render.emit_json(got)
    eff = got["effective"]

    def shown(field: str) -> str:
        value = eff[field]
        text = "no limit" if value == 0 else str(value)
        return text if got[field] is not None else f"{text} (default)"

    out().print(
        f"requests/min {shown('requests_per_minute')}, tokens/min {shown('tokens_per_minute')}, "
        f"at once {shown('max_concurrent')}"
    )


def _is_uuid(ref: str) -> bool:
    try:
        uuid.UUID(ref)
    except ValueError:
        return False
    return True
