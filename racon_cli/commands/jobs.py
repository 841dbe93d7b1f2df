"""`racon jobs ...`: inference jobs, their timings, placement and events."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import render
from ..client import Client, is_uuid
from .common import JsonOpt, client, handled, out

app = typer.Typer(help="Inference jobs.", no_args_is_help=True)


def _job_id(c: Client, ref: str) -> str:
    return (
        ref
        if is_uuid(ref)
        else str(c.by_prefix(c.get("/api/admin/jobs", params={"limit": 1000}), ref, "job")["id"])
    )


@app.command("ls")
@handled
def jobs_ls(
    state: Annotated[
        str | None, typer.Option(help="Only this state (RUNNING, COMPLETED, ...).")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    node: Annotated[
        str | None, typer.Option(help="Only jobs that ran on this node (name or id).")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """List jobs."""
    params = {
        k: v
        for k, v in (
            ("state", state.upper() if state else None),
            ("model", model),
            ("node", node),
            ("limit", str(limit)),
        )
        if v
    }
    with client() as c:
        jobs = c.get("/api/admin/jobs", params=params)
    if as_json:
        return render.emit_json(jobs)
    t = render.table("ID", "QUEUED", "MODEL", "STATE", "TOKENS", "TOK/S", "TTFT", "NODES")
    for j in jobs:
        t.add_row(
            render.short_id(j["id"]),
            render.when(j["queued_at"]),
            j["model"],
            render.state(j["state"]),
            f"{j['prompt_tokens']}→{j['completion_tokens']}",
            render.num(j.get("tokens_per_s")),
            f"{render.num(j.get('ttft_ms'), 0)} ms" if j.get("ttft_ms") is not None else "-",
            ", ".join(j.get("node_names") or []) or "-",
        )
    out().print(t if jobs else "No jobs.")


@app.command("show")
@handled
def jobs_show(
    job: Annotated[str, typer.Argument(help="Job id (or a unique prefix).")],
    as_json: JsonOpt = False,
) -> None:
    """Timings, nodes and layers, and events of one job."""
    with client() as c:
        j = c.get(f"/api/admin/jobs/{_job_id(c, job)}", what=f"job {job}")
    if as_json:
        return render.emit_json(j)
    tm = j.get("timings") or {}
    con = out()
    con.print(
        render.kv(
            [
                ("id", j["id"]),
                ("model", j["model"]),
                ("state", render.state(j["state"])),
                ("kind", j["kind"] + (" (streamed)" if j.get("stream") else "")),
                (
                    "tokens",
                    f"{j['prompt_tokens']} prompt → {j['completion_tokens']} completion (max {j['max_tokens']})",
                ),
                ("finish", j.get("finish_reason") or "-"),
                ("error", j.get("error") or "-"),
                ("queue", f"{render.num(tm.get('queue_ms'))} ms"),
                ("first token", f"{render.num(tm.get('to_first_token_ms'))} ms"),
                ("total", f"{render.num(tm.get('total_ms'))} ms"),
                ("tokens/s", render.num(tm.get("tokens_per_s"))),
                ("nodes", ", ".join(j.get("node_names") or []) or "-"),
            ],
            title=f"job {render.short_id(j['id'])}",
        )
    )
    devices = (j.get("placement") or {}).get("devices") or []
    if devices:
        t = render.table("NODE", "DEVICE", "LAYERS", title="\nPlacement")
        for d in devices:
            t.add_row(
                d.get("node") or render.short_id(d.get("node_id")),
                d.get("device", "-"),
                f"{d['layers'][0]}-{d['layers'][1] - 1}",
            )
        con.print(t)
    if j.get("events"):
        t = render.table("TIME", "EVENT", "MESSAGE", title="\nEvents")
        for e in j["events"]:
            t.add_row(render.when(e["created_at"]), e["kind"], e.get("message") or "")
        con.print(t)


@app.command("cancel")
@handled
def jobs_cancel(
    job: Annotated[str, typer.Argument(help="Job id (or a unique prefix).")],
    as_json: JsonOpt = False,
) -> None:
    """Cancel a queued or running job."""
    with client() as c:
        j = c.post(f"/api/admin/jobs/{_job_id(c, job)}/cancel", what=f"job {job}")
    if as_json:
        return render.emit_json(j)
    out().print(f"Job {render.short_id(j['id'])} is {j['state']}.")
