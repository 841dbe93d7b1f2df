"""`racon credits ...`: balance, ledger, and offline verification of signed receipts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

# Pure (cryptography only, no Django): the same check the controller runs. The `cli` extra carries
# cryptography, and tests/cli/test_imports.py holds this import to no Django.
from apps.credits.signing import receipt_verify

from .. import render
from ..client import EXIT_API, EXIT_CONFIG, ApiError
from .common import JsonOpt, client, connect, handled, out, settings

app = typer.Typer(help="Credits: balance, ledger, receipts.", no_args_is_help=True)


@app.command("balance")
@handled
def credits_balance(as_json: JsonOpt = False) -> None:
    """Your balance, what is held for running jobs, and what your nodes earned."""
    with client() as c:
        b = c.get("/api/credits/balance")
    if as_json:
        return render.emit_json(b)
    out().print(
        render.kv(
            [
                ("account", b["account"]["name"]),
                ("balance", render.credits(b["balance"])),
                (
                    "available",
                    render.credits(b["available"])
                    if b.get("available") is not None
                    else "unbounded",
                ),
                ("held", render.credits(b["held"])),
                (
                    "earned",
                    f"{render.credits(b['earned_total'])} ({render.credits(b['earned_recent'])} recently)",
                ),
                ("escrow", render.credits(b["escrow_held"])),
                ("standing", render.credits(b["standing"])),
            ],
            title="credits (1 credit = 1,000,000 µ)",
        )
    )


@app.command("ledger")
@handled
def credits_ledger(
    limit: Annotated[int, typer.Option(help="At most this many postings, newest first.")] = 20,
    kind: Annotated[
        str | None, typer.Option(help="Only this entry kind (GRANT, RESERVE, SETTLE, ...).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Your ledger postings."""
    params: dict[str, Any] = {"limit": limit}
    if kind:
        params["kind"] = kind.upper()
    with client() as c:
        page = c.get("/api/credits/ledger", params=params)
    if as_json:
        return render.emit_json(page)
    t = render.table("TIME", "KIND", "MEMO", "AMOUNT")
    for p in page["results"]:
        amount = Text(render.credits(p["amount"]), style="red" if p["amount"] < 0 else "green")
        t.add_row(render.when(p["created_at"]), p["kind"], p.get("memo") or "", amount)
    out().print(t if page["results"] else "No postings.")


@app.command("verify")
@handled
def credits_verify(
    receipt_file: Annotated[
        Path, typer.Argument(help="A receipt as JSON (the document, or the API's receipt object).")
    ],
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", help="PEM or base64 key file: verify fully offline."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify a receipt's Ed25519 signature locally, with the controller's public key."""
    try:
        doc = json.loads(receipt_file.read_text())
    except OSError as exc:
        raise ApiError(
            f"cannot read {receipt_file}: {exc.strerror or exc}", exit_code=EXIT_CONFIG
        ) from None
    except ValueError as exc:
        raise ApiError(f"{receipt_file} is not JSON: {exc}", exit_code=EXIT_CONFIG) from None
    if isinstance(doc, dict) and isinstance(doc.get("document"), dict):
        doc = doc["document"]
    if public_key is not None:
        try:
            key_text = public_key.read_text()
        except OSError as exc:
            raise ApiError(
                f"cannot read {public_key}: {exc.strerror or exc}", exit_code=EXIT_CONFIG
            ) from None
    else:
        s = settings()
        with connect(s.url, s.key) as c:
            key_text = c.get("/api/credits/public-key")["pem"]
    result = receipt_verify(doc, key_text)
    if as_json:
        render.emit_json({"valid": result.valid, "reason": result.reason})
    elif result.valid:
        out().print(
            f"valid: receipt {doc.get('receipt_id', '?')} — {doc.get('credits')} µ "
            f"to node {doc.get('node_name')} for job {render.short_id(doc.get('job_id'))}"
        )
    if not result.valid:
        if not as_json:
            render.err(f"receipt is not valid: {result.reason}")
        raise typer.Exit(EXIT_API)


@app.command("earnings")
@handled
def credits_earnings(
    days: Annotated[int, typer.Option(help="How many days back.")] = 30,
    node: Annotated[str | None, typer.Option(help="Only this node (id).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """What your nodes earned, per node and per day: credits, jobs served, receipts."""
    params: dict[str, Any] = {"days": days}
    if node:
        params["node"] = node
    with client() as c:
        rows = c.get("/api/credits/earnings", params=params)
    if as_json:
        return render.emit_json(rows)
    t = render.table("DAY", "NODE", "CREDITS", "JOBS", "RECEIPTS")
    for r in rows:
        t.add_row(
            str(r["day"]),
            r["node_name"],
            render.credits(r["credits"]),
            str(r["jobs"]),
            str(r["receipts"]),
        )
    out().print(t if rows else f"No earnings in the last {days} days.")
