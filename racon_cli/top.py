"""`racon top`: a live terminal view of the cluster (textual), over the same REST API as the CLI.

Keys: d drain / u undrain the selected node, c cancel the selected job (each asks first),
r refresh now, tab moves between tables, q quits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Header, Label, Static

from . import render
from .client import error_message

ACTIVE_JOB_STATES = ("QUEUED", "DISPATCHED", "RUNNING")


class Confirm(ModalScreen[bool]):
    """Yes/no before anything changes on the cluster."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "Cancel"),
    ]
    DEFAULT_CSS = (
        "\n"
        "    Confirm { align: center middle; }\n"
        "    Confirm > Grid { grid-size: 2; grid-gutter: 1 2; grid-rows: auto 3; padding: 1 2;"
        " width: 64; height: auto; border: thick $warning; background: $surface; }\n"
        "    Confirm #question { column-span: 2; width: 100%; content-align: center middle; }\n"
        "    Confirm Button { width: 100%; }\n"
        "    "
    )

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(self.question, id="question")
            yield Button("Yes (y)", variant="warning", id="yes")
            yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter alone must not change the cluster

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class TopApp(App[None]):
    TITLE = "racon top"
    CSS = """
    Screen { layout: vertical; }
    .title { color: $text-muted; text-style: bold; padding: 0 1; }
    #top-row { height: 1fr; }
    #nodes-box { width: 2fr; }
    #node-detail { width: 1fr; border-left: solid $primary-background; padding: 0 1; }
    #mid-row { height: 1fr; }
    #deployments-box, #jobs-box { width: 1fr; }
    #events-box { height: 12; }
    DataTable { height: 1fr; }
    #status { height: 1; padding: 0 1; color: $text-muted; }
    #status.error { color: $error; }
    """
    BINDINGS = [
        Binding("d", "drain", "Drain node"),
        Binding("u", "undrain", "Undrain node"),
        Binding("c", "cancel_job", "Cancel job"),
        Binding("r", "refresh", "Refresh"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        *,
        url: str,
        key: str,
        interval: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__()
        self.url = url.rstrip("/")
        self.key = key
        self.interval = interval
        self.transport = transport
        self.nodes: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.refreshes = 0
        self.last_error = ""

    # --- layout -----------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=True)
        with Horizontal(id="top-row"):
            with Vertical(id="nodes-box"):
                yield Static("Nodes", classes="title")
                yield DataTable(id="nodes", cursor_type="row", zebra_stripes=True)
            yield Static("Select a node", id="node-detail")
        with Horizontal(id="mid-row"):
            with Vertical(id="deployments-box"):
                yield Static("Deployments", classes="title")
                yield DataTable(id="deployments", cursor_type="row")
            with Vertical(id="jobs-box"):
                yield Static("Jobs (active first)", classes="title")
                yield DataTable(id="jobs", cursor_type="row")
        with Vertical(id="events-box"):
            yield Static("Recent events", classes="title")
            yield DataTable(id="events", cursor_type="none")
        yield Static("connecting…", id="status")
        yield Footer()

    @property
    def _main(self) -> Any:
        """The main screen: a poll may land while a confirmation dialog is the active screen."""
        return self.screen_stack[0]

    def on_mount(self) -> None:
        self.sub_title = self.url
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.key}", "User-Agent": "racon-top"},
            timeout=httpx.Timeout(10.0, connect=3.0),
            transport=self.transport,
        )
        cols = {
            "nodes": [
                ("name", "NAME"),
                ("state", "STATE"),
                ("cores", "CORES"),
                ("ram", "RAM FREE/TOTAL"),
                ("vram", "VRAM"),
                ("hb", "HEARTBEAT"),
            ],
            "deployments": [
                ("model", "MODEL"),
                ("state", "STATE"),
                ("nodes", "NODES"),
                ("tps", "PRED TOK/S"),
            ],
            "jobs": [
                ("id", "JOB"),
                ("model", "MODEL"),
                ("state", "STATE"),
                ("tokens", "TOKENS"),
                ("tps", "TOK/S"),
                ("nodes", "NODES"),
            ],
            "events": [
                ("time", "TIME"),
                ("kind", "EVENT"),
                ("node", "NODE"),
                ("message", "MESSAGE"),
            ],
        }
        for table_id, columns in cols.items():
            table = self._main.query_one(f"#{table_id}", DataTable)
            for key, label in columns:
                table.add_column(label, key=key)
        self._main.query_one("#nodes", DataTable).focus()
        self.set_interval(self.interval, self.poll)
        self.poll()

    async def on_unmount(self) -> None:
        await self.http.aclose()

    # --- data -------------------------------------------------------------------------------------

    async def _get(self, path: str, **params: Any) -> Any:
        resp = await self.http.get(path, params=params or None)
        if resp.status_code >= 400:
            reason, _ = error_message(resp)
            raise RuntimeError(f"{resp.status_code}: {reason or resp.reason_phrase}")
        return resp.json()

    @work(exclusive=True, group="poll")
    async def poll(self) -> None:
        """One refresh of every table (a newer poll replaces a slow one)."""
        try:
            nodes, deps, jobs, events = await asyncio.gather(
                self._get("/api/admin/nodes"),
                self._get("/api/admin/deployments"),
                self._get("/api/admin/jobs", limit=40),
                self._get("/api/admin/events", limit=20),
            )
        except (httpx.HTTPError, RuntimeError) as exc:
            self._status(
                f"cannot refresh from {self.url}: {exc or exc.__class__.__name__}", error=True
            )
            return
        if not self._main.query("#nodes"):
            return  # the app is closing: its screens are gone while this poll was in flight
        self.nodes = {n["id"]: n for n in nodes}
        names = {n["id"]: n["name"] for n in nodes}
        self._sync(
            "nodes",
            {
                n["id"]: (
                    n["name"] + (" ⏸" if n.get("drain_requested") else ""),
                    render.state(n["state"]),
                    str(n["cpu_logical_cores"]),
                    f"{render.human_bytes(n['ram_available'])}/{render.human_bytes(n['ram_total'])}",
                    f"{render.human_bytes(n['vram_free'])}/{render.human_bytes(n['vram_total'])}"
                    if n.get("vram_total")
                    else "-",
                    render.age(n.get("heartbeat_age")),
                )
                for n in nodes
            },
        )
        active = [d for d in deps if d["state"] not in ("STOPPED",)][:30]
        self._sync(
            "deployments",
            {
                d["id"]: (
                    d["model"],
                    render.state(d["state"]),
                    ", ".join(d.get("node_names") or []) or "-",
                    render.num((d.get("plan") or {}).get("predicted_tokens_per_s")),
                )
                for d in active
            },
        )
        ordered = sorted(jobs, key=lambda j: (j["state"] not in ACTIVE_JOB_STATES,))[:30]
        self.jobs = {j["id"]: j for j in ordered}
        self._sync(
            "jobs",
            {
                j["id"]: (
                    render.short_id(j["id"]),
                    j["model"],
                    render.state(j["state"]),
                    f"{j['prompt_tokens']}→{j['completion_tokens']}",
                    render.num(j.get("tokens_per_s")),
                    ", ".join(j.get("node_names") or []) or "-",
                )
                for j in ordered
            },
        )
        self._sync(
            "events",
            {
                str(e["id"]): (
                    render.when(e["created_at"])[11:],
                    e["kind"],
                    names.get(str(e.get("node") or ""), "-"),
                    (e.get("message") or "")[:80],
                )
                for e in events
            },
        )
        await self._show_selected_node()
        self.refreshes += 1
        ready = sum(1 for n in nodes if n["state"] == "READY")
        running = sum(1 for j in jobs if j["state"] in ACTIVE_JOB_STATES)
        self._status(
            f"{len(nodes)} nodes ({ready} ready) · "
            f"{len([d for d in deps if d['state'] == 'READY'])} deployments ready · "
            f"{running} jobs active · refresh every {self.interval:g}s"
        )

    def _sync(self, table_id: str, rows: dict[str, tuple[Any, ...]]) -> None:
        """Update rows in place (the cursor stays on the same item), add new ones, drop gone ones."""
        table = self._main.query_one(f"#{table_id}", DataTable)
        keys = [c.key for c in table.columns.values()]
        existing = {rk.value for rk in table.rows}
        for gone in existing - set(rows):
            table.remove_row(gone)
        for key, values in rows.items():
            if key in existing:
                for col, value in zip(keys, values, strict=True):
                    table.update_cell(key, col, value, update_width=True)
            else:
                table.add_row(*values, key=key)

    def _selected(self, table_id: str) -> str | None:
        table = self._main.query_one(f"#{table_id}", DataTable)
        if not table.row_count:
            return None
        try:
            return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        except Exception:  # no row under the cursor
            return None

    async def _show_selected_node(self) -> None:
        node_id = self._selected("nodes")
        detail = self._main.query_one("#node-detail", Static)
        if node_id is None:
            detail.update("No nodes yet. Create a token with `racon tokens create`.")
            return
        try:
            n = await self._get(f"/api/admin/nodes/{node_id}")
        except (httpx.HTTPError, RuntimeError):
            return
        tele = n.get("telemetry") or {}
        text = Text()
        text.append(f"{n['name']}\n", style="bold")
        text.append_text(render.state(n["state"]))
        text.append(f"  {n['address']}:{n['rpc_port']}\n\n")
        for label, value in (
            (
                "CPU",
                n.get("cpu_model")
                or ((n.get("hardware") or {}).get("cpu") or {}).get("model")
                or "-",
            ),
            ("cores", f"{n['cpu_physical_cores']} phys / {n['cpu_logical_cores']} log"),
            (
                "load",
                f"{render.num(tele.get('cpu_percent'), 0)}%" if "cpu_percent" in tele else "-",
            ),
            ("RAM free", render.human_bytes(tele.get("mem_available") or n["ram_available"])),
            ("RAM total", render.human_bytes(n["ram_total"])),
            (
                "GPU free",
                ", ".join(render.human_bytes(x) for x in tele.get("gpu_free") or []) or "-",
            ),
            ("jobs", str(len(tele.get("jobs") or []))),
            (
                "RPC worker",
                "running" if (tele.get("rpc_worker") or {}).get("running") else "stopped",
            ),
            ("heartbeat", f"{render.age(n.get('heartbeat_age'))} ago"),
            ("agent", n.get("agent_version") or "-"),
        ):
            text.append(f"{label:>10}  ", style="dim")
            text.append(f"{value}\n")
        deps = n.get("deployments") or []
        if deps:
            text.append("\nserves\n", style="dim")
            for d in deps[:5]:
                text.append(f"  {d['model']} ")
                text.append_text(render.state(d["state"]))
                text.append("\n")
        detail.update(text)

    def _status(self, message: str, *, error: bool = False) -> None:
        found = self._main.query("#status")
        if not found:
            return  # the app is closing (a poll's await outlived its screens)
        status = found.first(Static)
        status.update(message)
        status.set_class(error, "error")
        self.last_error = message if error else ""

    @on(DataTable.RowHighlighted, "#nodes")
    async def node_highlighted(self) -> None:
        await self._show_selected_node()

    # --- actions ----------------------------------------------------------------------------------

    def action_refresh(self) -> None:
        self.poll()

    def action_drain(self) -> None:
        self._node_action("drain", "Drain {name}? It takes no new work; running jobs finish.")

    def action_undrain(self) -> None:
        self._node_action("undrain", "Undrain {name}? It accepts new work again.")

    def _node_action(self, action: str, question: str) -> None:
        node_id = self._selected("nodes")
        if node_id is None or node_id not in self.nodes:
            self.notify("Select a node first.", severity="warning")
            return
        name = self.nodes[node_id]["name"]

        def answered(yes: bool | None) -> None:
            if yes:
                self._post(f"/api/admin/nodes/{node_id}/{action}", f"{action}ed {name}")

        self.push_screen(Confirm(question.format(name=name)), answered)

    def action_cancel_job(self) -> None:
        job_id = self._selected("jobs")
        job = self.jobs.get(job_id or "")
        if job is None:
            self.notify("Select a job first (tab to the jobs table).", severity="warning")
            return
        if job["state"] not in ACTIVE_JOB_STATES:
            self.notify(
                f"Job {render.short_id(job_id)} is already {job['state']}.", severity="warning"
            )
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._post(
                    f"/api/admin/jobs/{job_id}/cancel", f"cancelled job {render.short_id(job_id)}"
                )

        self.push_screen(
            Confirm(f"Cancel job {render.short_id(job_id)} ({job['model']})?"), answered
        )

    @work(group="actions")
    async def _post(self, path: str, done: str) -> None:
        try:
            resp = await self.http.post(path)
        except httpx.HTTPError as exc:
            self.notify(f"failed: {exc}", severity="error")
            return
        if resp.status_code >= 400:
            reason, _ = error_message(resp)
            self.notify(f"{resp.status_code}: {reason or resp.reason_phrase}", severity="error")
            return
        body = resp.json()
        self.notify(f"{done}: now {body.get('state', '?')}")
        self.poll()
