"""`racon nodes ...` and `racon diagnose`: state, hardware, drain, and diagnostics bundles."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from .. import render
from ..client import EXIT_API, EXIT_CONFIG, ApiError
from .common import JsonOpt, client, handled, out

app = typer.Typer(
    help="Nodes: list, inspect, drain and undrain, and the link matrix.", no_args_is_help=True
)


def _node_rows(nodes: list[dict[str, Any]]) -> Table:
    t = render.table(
        "NAME", "ID", "STATE", "CORES", "RAM FREE/TOTAL", "VRAM FREE/TOTAL", "HEARTBEAT", "ADDRESS"
    )
    for n in nodes:
        vram = (
            f"{render.human_bytes(n['vram_free'])}/{render.human_bytes(n['vram_total'])}"
            if n.get("vram_total")
            else "-"
        )
        name = n["name"] + (" (drain)" if n.get("drain_requested") else "")
        t.add_row(
            name,
            render.short_id(n["id"]),
            render.state(n["state"]),
            str(n["cpu_logical_cores"]),
            f"{render.human_bytes(n['ram_available'])}/{render.human_bytes(n['ram_total'])}",
            vram,
            render.age(n.get("heartbeat_age")),
            n.get("address") or "-",
        )
    return t


@app.command("ls")
@handled
def nodes_ls(
    state: Annotated[
        str | None, typer.Option(help="Only nodes in this state (READY, OFFLINE, ...).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List nodes."""
    with client() as c:
        nodes = c.get("/api/admin/nodes", params={"state": state.upper()} if state else None)
    if as_json:
        return render.emit_json(nodes)
    if not nodes:
        out().print(
            "No nodes."
            + (
                ""
                if state
                else " Create a token with `racon tokens create LABEL` and run its command on a machine."
            )
        )
        return
    out().print(_node_rows(nodes))


@app.command("show")
@handled
def nodes_show(
    node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False
) -> None:
    """Hardware, telemetry, deployments and recent events of one node."""
    with client() as c:
        n = c.node(node)
    if as_json:
        return render.emit_json(n)
    tele = n.get("telemetry") or {}
    gpus = (
        ", ".join(
            f"{g.get('name')} ({render.human_bytes(g.get('vram_total'))})"
            for g in (n.get("hardware") or {}).get("gpus") or []
        )
        or "none"
    )
    con = out()
    con.print(
        render.kv(
            [
                ("name", Text(n["name"], style="bold")),
                ("id", n["id"]),
                ("state", render.state(n["state"])),
                (
                    "drain",
                    "requested" + (" (drained)" if n.get("state") == "DRAINED" else "")
                    if n.get("drain_requested")
                    else "no",
                ),
                ("address", f"{n['address']}:{n['rpc_port']}"),
                ("agent", n.get("agent_version") or "-"),
                (
                    "cpu",
                    (
                        f"{n.get('cpu_model') or ((n.get('hardware') or {}).get('cpu') or {}).get('model') or '-'}"
                        f" · {n['cpu_physical_cores']} physical / {n['cpu_logical_cores']} logical cores"
                    ),
                ),
                (
                    "ram",
                    f"{render.human_bytes(n['ram_available'])} free of {render.human_bytes(n['ram_total'])}",
                ),
                ("gpus", gpus),
                ("disk free", render.human_bytes(n.get("disk_free"))),
                (
                    "benchmark",
                    f"{render.num(n.get('gflops'))} GFLOPS · {render.num(n.get('mem_bandwidth_gbps'))} GB/s",
                ),
                ("heartbeat", f"{render.age(n.get('heartbeat_age'))} ago"),
                (
                    "cpu load",
                    f"{render.num(tele.get('cpu_percent'), 0)}%" if "cpu_percent" in tele else "-",
                ),
                ("jobs", str(len(tele.get("jobs") or []))),
                (
                    "rpc worker",
                    "running" if (tele.get("rpc_worker") or {}).get("running") else "stopped",
                ),
            ],
            title=f"node {n['name']}",
        )
    )
    deps = n.get("deployments") or []
    if deps:
        t = render.table("DEPLOYMENT", "MODEL", "STATE", title="\nDeployments")
        for d in deps:
            t.add_row(render.short_id(d["id"]), d["model"], render.state(d["state"]))
        con.print(t)
    events = (n.get("events") or [])[:10]
    if events:
        t = render.table("TIME", "EVENT", "MESSAGE", title="\nRecent events")
        for e in events:
            t.add_row(render.when(e["created_at"]), e["kind"], e.get("message") or "")
        con.print(t)


@app.command("links")
@handled
def nodes_links(as_json: JsonOpt = False) -> None:
    """The measured link matrix: from → to, RTT, bandwidth, how each was measured, and its age."""
    with client() as c:
        data = c.get("/api/admin/nodes/links")
    if as_json:
        return render.emit_json(data)
    links = data.get("links") or []
    if not links:
        out().print(
            "No links measured yet (nodes measure their peers when they turn READY, and every "
            f"{render.num(data.get('probe_interval_seconds'), 0)} s)."
        )
        return
    t = render.table("FROM", "TO", "RTT MS", "MBIT/S", "METHOD", "AGE")
    for lk in links:
        method = lk.get("bandwidth_method") or "-"
        age = render.age(lk.get("age_seconds")) + (" (expired)" if lk.get("expired") else "")
        t.add_row(
            lk["source_name"],
            lk["target_name"],
            render.num(lk.get("rtt_ms"), 3),
            render.num(lk.get("bandwidth_mbps"), 1),
            method,
            age,
        )
    out().print(t)
    out().print(
        f"Links older than {render.num(data.get('max_age_seconds'), 0)} s are expired: the "
        "scheduler assumes its default link for them."
    )


def _node_action(node: str, action: str, as_json: bool) -> None:
    with client() as c:
        n = c.node(node)
        after = c.post(f"/api/admin/nodes/{n['id']}/{action}")
    if as_json:
        return render.emit_json(after)
    line = Text(f"{action}ed {after['name']}: ")
    line.append_text(render.state(after["state"]))
    if action == "drain":
        line.append(
            " (drained: current work has ended)"
            if after.get("state") == "DRAINED"
            else " (moving its deployments, finishing current work)"
        )
    out().print(line)


@app.command("drain")
@handled
def nodes_drain(
    node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False
) -> None:
    """Stop assigning new work to a node; its deployments move elsewhere and running jobs finish."""
    _node_action(node, "drain", as_json)


@app.command("undrain")
@handled
def nodes_undrain(
    node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False
) -> None:
    """Accept new work on a drained node again."""
    _node_action(node, "undrain", as_json)


@app.command("gpu-challenge")
@handled
def nodes_gpu_challenge(
    node: Annotated[str, typer.Argument(help="Node name or id.")],
    device: Annotated[
        str | None, typer.Option(help="The GPU by llama.cpp's name (CUDA0, Vulkan0).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Time and check a node's GPU claim on the GPU now (at most one challenge per node an hour)."""
    with client() as c:
        n = c.node(node)
        after = c.post(
            f"/api/admin/nodes/{n['id']}/gpu-challenge", {"device": device} if device else {}
        )
    if as_json:
        return render.emit_json(after)
    out().print(
        f"GPU challenge of {n['name']}:{after['device']} queued: its outcome is an event "
        "(GPU_SPEED_VERIFIED or GPU_CHALLENGE_FAILED)."
    )


@app.command("gpu-challenge-clear")
@handled
def nodes_gpu_challenge_clear(
    node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False
) -> None:
    """Clear a node's failed GPU challenge (it stands until cleared) and the hourly limit."""
    with client() as c:
        n = c.node(node)
        after = c.post(f"/api/admin/nodes/{n['id']}/gpu-challenge/clear")
    if as_json:
        return render.emit_json(after)
    out().print(
        f"GPU challenge record of {n['name']} cleared: its GPUs stay at the floor until a "
        "challenge passes."
        if after["cleared"]
        else f"{n['name']} has no GPU challenge record to clear."
    )


@handled
def diagnose(
    node: Annotated[str, typer.Argument(help="Node name or id.")],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where to save the tar.gz (default: the server's file name, here).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Download a node's diagnostics bundle (tar.gz) and summarise it."""
    with client(timeout=120) as c:
        n = c.node(node)
        path = f"/api/admin/nodes/{n['id']}/diagnostics"
        try:
            resp = c.request("GET", path, what=path)
        except ApiError as exc:
            if exc.status == 404 and not (isinstance(exc.body, dict) and "error" in exc.body):
                # The node exists (we just read it), and the answer is not the API's JSON 404:
                # this controller predates the diagnostics endpoint.
                raise ApiError(
                    f"404 not found: this controller has no diagnostics endpoint (GET {path}); upgrade it",
                    status=404,
                ) from None
            raise
    name = output
    if name is None:
        disposition = resp.headers.get("content-disposition", "")
        fname = (
            disposition.split("filename=")[-1].strip('"; ')
            if "filename=" in disposition
            else f"racon-diagnose-{n['name']}.tar.gz"
        )
        name = Path(Path(fname).name)
    try:
        name.write_bytes(resp.content)
    except OSError as exc:
        raise ApiError(
            f"cannot write {name}: {exc.strerror or exc}", exit_code=EXIT_CONFIG
        ) from None
    members: list[dict[str, Any]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
            members = [{"name": m.name, "size": m.size} for m in tar.getmembers() if m.isfile()]
    except tarfile.TarError as exc:
        raise ApiError(
            f"saved {name}, but it is not a readable tar.gz: {exc}", exit_code=EXIT_API
        ) from None
    summary = {
        "node": n["name"],
        "node_id": n["id"],
        "state": n["state"],
        "file": str(name),
        "bytes": len(resp.content),
        "members": members,
    }
    if as_json:
        return render.emit_json(summary)
    con = out()
    con.print(
        f"Saved diagnostics of {n['name']} ({n['state']}) to {name} "
        f"({render.human_bytes(len(resp.content))}, {len(members)} files)"
    )
    t = render.table("FILE", "SIZE")
    for m in members:
        t.add_row(m["name"], render.human_bytes(m["size"]))
    con.print(t)
