"""`racon deploy` and `racon deployments ...`: placement plans, loading, placed instances."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from .. import render
from ..client import ApiError, Client, is_uuid
from .common import JsonOpt, client, handled, out

app = typer.Typer(help="Placed, loaded model instances.", no_args_is_help=True)


def _print_plan(plan: dict[str, Any]) -> None:
    con = out()
    con.print(
        Text(
            f"Placement of {plan.get('model')} — {plan.get('n_layer')} layers, primary "
            f"{plan.get('primary_name')}, engine {plan.get('engine') or 'llamacpp'}",
            style="bold",
        )
    )
    bar, legend = render.layer_bar(plan)
    con.print(bar)
    for name, colour, layers, mem in legend:
        line = Text("██ ", style=colour)
        line.append(f"{name}: {layers} layers, {render.human_bytes(mem)}")
        con.print(line)
    t = render.table("NODE", "DEVICE", "LAYERS", "MEMORY", "ENDPOINT")
    for d in plan.get("devices", []):
        t.add_row(
            d.get("node_name") or render.short_id(d["node_id"]),
            d["device"],
            f"{d['layer_start']}-{d['layer_end'] - 1}"
            if d["layer_end"] > d["layer_start"]
            else "-",
            render.human_bytes(d.get("memory_bytes")),
            d.get("endpoint") or "(primary)",
        )
    con.print(t)
    con.print(
        f"Predicted: {render.num(plan.get('predicted_tokens_per_s'))} tokens/s, "
        f"{render.num(plan.get('predicted_ttft_ms'), 0)} ms to first token "
        f"(n_ctx {plan.get('n_ctx')} × {plan.get('n_parallel')} slots, "
        f"{plan.get('n_threads')} threads)"
    )
    for line in plan.get("explanation") or []:
        con.print(f"  • {line}")


@handled
def deploy(
    model: Annotated[str, typer.Argument(help="Registered model name.")],
    preview: Annotated[
        bool, typer.Option("--preview", help="Show the placement plan only; load nothing.")
    ] = False,
    nodes: Annotated[
        str | None,
        typer.Option("--nodes", help="Pin to these nodes (names or ids, comma-separated)."),
    ] = None,
    spread: Annotated[
        bool, typer.Option("--spread", help="Use every pinned node even when one would do.")
    ] = False,
    n_ctx: Annotated[
        int | None, typer.Option("--n-ctx", help="Context length (server default 2048).")
    ] = None,
    n_parallel: Annotated[
        int | None,
        typer.Option(
            "--n-parallel", help="Parallel slots (default: as many as memory allows, up to 16)."
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="llamacpp (llama-server, split over nodes when needed) or vllm (one node, the "
            "model's safetensors directory). Omitted: the scheduler's choice (--preview says "
            "which and why).",
        ),
    ] = None,
    allow_same_node: Annotated[
        bool,
        typer.Option(
            "--allow-same-node",
            help="Allow another replica on a node that already serves this model.",
        ),
    ] = False,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait until READY or FAILED.")
    ] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for READY.")] = 600.0,
    as_json: JsonOpt = False,
) -> None:
    """Deploy a model (placement, RPC workers, load), showing progress until it is READY or FAILED."""
    body: dict[str, Any] = {"model": model, "spread": spread}
    if nodes:
        body["nodes"] = [n.strip() for n in nodes.split(",") if n.strip()]
    if n_ctx is not None:
        body["n_ctx"] = n_ctx
    if n_parallel is not None:
        body["n_parallel"] = n_parallel
    if allow_same_node:
        body["allow_same_node"] = True
    if engine:
        body["engine"] = engine
    with client() as c:
        if preview:
            plan = c.post("/api/admin/deployments/preview", body)
            return render.emit_json(plan) if as_json else _print_plan(plan)
        dep = c.post("/api/admin/deployments", body)
        if wait:
            dep = _wait_deployment(c, dep, timeout=timeout, show=not as_json)
    if as_json:
        return render.emit_json(dep)
    if dep["state"] == "READY":
        tps = (dep.get("plan") or {}).get("predicted_tokens_per_s")
        out().print(
            f"Deployment {render.short_id(dep['id'])} of {dep['model']} is READY "
            f"on {', '.join(dep.get('node_names') or []) or '-'} "
            f"(predicted {render.num(tps)} tokens/s)"
        )
    else:
        out().print(
            f"Deployment {render.short_id(dep['id'])} of {dep['model']} is {dep['state']}; "
            "follow it with `racon deployments ls`"
        )


def _wait_deployment(
    c: Client, dep: dict[str, Any], *, timeout: float, show: bool
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=render.console(),
        transient=True,
        disable=not show,
    )
    with progress:
        task = progress.add_task(f"Deploying {dep['model']}: {dep['state']}", total=None)
        while dep["state"] in ("PLANNING", "LOADING"):
            if time.monotonic() > deadline:
                raise ApiError(
                    f"deployment {render.short_id(dep['id'])} still {dep['state']} "
                    f"after {timeout:.0f}s (it keeps going; see `racon deployments ls`)"
                )
            time.sleep(0.5)
            dep = c.get(f"/api/admin/deployments/{dep['id']}")
            nodes = ", ".join(dep.get("node_names") or [])
            progress.update(
                task,
                description=f"Deploying {dep['model']}: {dep['state']}"
                + (f" on {nodes}" if nodes else ""),
            )
    if dep["state"] in ("FAILED", "STOPPED"):
        raise ApiError(
            f"deployment {render.short_id(dep['id'])} {dep['state']}: "
            f"{dep.get('error') or 'see `racon deployments ls`'}"
        )
    return dep


@app.command("ls")
@handled
def deployments_ls(
    state: Annotated[str | None, typer.Option(help="Only this state (READY, FAILED, ...).")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List deployments."""
    params = {k: v for k, v in (("state", state.upper() if state else None), ("model", model)) if v}
    with client() as c:
        deps = c.get("/api/admin/deployments", params=params or None)
    if as_json:
        return render.emit_json(deps)
    active = ("PLANNING", "LOADING", "READY", "DEGRADED")
    t = render.table("ID", "MODEL", "STATE", "NODES", "CTX", "SLOTS", "QUEUE", "TOK/S", "CREATED")
    for d in deps:
        live = d["state"] in active
        slots = f"{d.get('slots_in_use', 0)}/{d['n_parallel']}" if live else "-"
        t.add_row(
            render.short_id(d["id"]),
            d["model"],
            render.state(d["state"]),
            ", ".join(d.get("node_names") or []) or "-",
            str(d["n_ctx"]),
            slots,
            str(d.get("queue_depth", 0)) if live else "-",
            render.num((d.get("plan") or {}).get("predicted_tokens_per_s")),
            render.when(d["created_at"]),
        )
    out().print(t if deps else "No deployments.")
    # Per model: its replicas and queue (every row of a model carries the model's figures).
    models: dict[str, dict[str, Any]] = {}
    for d in deps:
        if d["state"] in active:
            m = models.setdefault(
                d["model"],
                {
                    "replicas": d.get("replicas", 0),
                    "in_use": 0,
                    "slots": 0,
                    "queue": d.get("model_queue_depth", 0),
                    "wait": d.get("model_queue_wait_seconds", 0.0),
                },
            )
            m["in_use"] += int(d.get("slots_in_use") or 0)
            m["slots"] += int(d["n_parallel"]) if d["state"] in ("READY", "DEGRADED") else 0
    if models:
        s = render.table("MODEL", "REPLICAS", "SLOTS IN USE", "WAITING", "QUEUE WAIT")
        for name, m in sorted(models.items()):
            s.add_row(
                name,
                str(m["replicas"]),
                f"{m['in_use']}/{m['slots']}",
                str(m["queue"]),
                f"{render.num(m['wait'])} s",
            )
        out().print(s)


@app.command("stop")
@handled
def deployments_stop(
    deployment: Annotated[str, typer.Argument(help="Deployment id (or a unique prefix).")],
    as_json: JsonOpt = False,
) -> None:
    """Stop a deployment (its running jobs are cancelled)."""
    with client() as c:
        dep_id = (
            deployment
            if is_uuid(deployment)
            else c.by_prefix(c.get("/api/admin/deployments"), deployment, "deployment")["id"]
        )
        dep = c.post(f"/api/admin/deployments/{dep_id}/stop", what=f"deployment {deployment}")
    if as_json:
        return render.emit_json(dep)
    out().print(f"Deployment {render.short_id(dep['id'])} of {dep['model']} is {dep['state']}.")
