"""The web UI's read side: page data built from the app selectors, and the live rows the dashboard
consumer pushes (``render_node_row`` / ``render_deployment_row``, HTML with ``hx-swap-oob``).

Everything here reads; writes go through the app services from ``ui_views``. Visibility lives here
too, in one place: staff see everything, a contributor sees the nodes of their own account, the
deployments those nodes serve, and their own jobs, ledger and receipts.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Avg, Q, QuerySet, Sum
from django.http import Http404
from django.template.loader import render_to_string
from django.utils import timezone

from apps.accounts.models import Account, AccountKind
from apps.credits import selectors as credit_selectors
from apps.credits.ledger import account_for_user
from apps.credits.models import Receipt
from apps.jobs import kvcache, series
from apps.jobs import selectors as job_selectors
from apps.jobs.models import Deployment, Job, JobAttempt
from apps.jobs.states import (
    DEPLOYMENT_ACTIVE,
    DEPLOYMENT_ENDED,
    JOB_IN_FLIGHT,
    JOB_OPEN,
    DeploymentState,
    JobState,
)
from apps.models_repo.models import Model
from apps.nodes import selectors as node_selectors
from apps.nodes.lending import lending_view
from apps.nodes.links import link_matrix
from apps.nodes.models import EnrollmentToken, Node
from apps.nodes.states import POOL, NodeState
from racon import ids
from racon.ids import AccountId, DeploymentId, JobId, NodeId

from .ui_failures import failure_explained

# Colours for the placement bar, one per node in plan order (kept in step with racon.css).
NODE_COLOURS = (
    "#2563eb",
    "#16a34a",
    "#d97706",
    "#9333ea",
    "#dc2626",
    "#0891b2",
    "#4d7c0f",
    "#db2777",
)
TOKENS_WINDOW_SECONDS = 60


@dataclass(frozen=True)
class Viewer:
    """Who is looking: staff see everything; everyone else is limited to ``account_id``."""

    user: Any
    is_staff: bool
    account_id: AccountId

    @property
    def scope(self) -> Any:
        """The account filter for selectors: None (everything) for staff."""
        return None if self.is_staff else self.account_id


def viewer_for(user: Any) -> Viewer:
    return Viewer(
        user=user,
        is_staff=bool(user.is_staff),
        account_id=ids.account_id(account_for_user(user=user).id),
    )


# --- nodes ---------------------------------------------------------------------------------------


def _visible_nodes(viewer: Viewer) -> QuerySet[Node]:
    qs = Node.objects.all()
    return qs if viewer.is_staff else qs.filter(account_id=viewer.account_id)


def node_for(viewer: Viewer, node_id: str) -> Node:
    """The node if this viewer may see it; 404 otherwise (a contributor learns nothing of others')."""
    node = _visible_nodes(viewer).filter(pk=node_id).first()
    if node is None:
        raise Http404("no such node")
    return node


def _node_rows(nodes: list[Node], *, now: datetime) -> list[dict[str, Any]]:
    ages = node_selectors.heartbeat_ages([str(n.id) for n in nodes], now=now)
    rows = []
    for n in nodes:
        tele = node_selectors.node_telemetry(node_id=ids.node_id(n.id))
        rows.append({"node": n, "age": ages.get(str(n.id)), "telemetry": tele})
    return rows


def node_links_page(*, user: Any, now: datetime) -> dict[str, Any]:
    """The link matrix among the nodes this viewer may see (a contributor: their own)."""
    viewer = viewer_for(user)
    visible = None
    if not viewer.is_staff:
        visible = {str(pk) for pk in _visible_nodes(viewer).values_list("id", flat=True)}
    return {
        "links": link_matrix(now=now, node_ids=visible),
        "link_max_age": settings.LINK_MAX_AGE_SECONDS,
    }


def node_list_page(*, user: Any, state: str | None = None, now: datetime) -> dict[str, Any]:
    viewer = viewer_for(user)
    nodes = node_selectors.node_list(state=state or None, account_id=viewer.scope)
    return {
        **node_links_page(user=user, now=now),
        "rows": _node_rows(nodes, now=now),
        "states": NodeState.values,
        "state": state or "",
        "is_staff": viewer.is_staff,
    }


def node_detail_page(*, user: Any, node_id: NodeId, now: datetime) -> dict[str, Any]:
    viewer = viewer_for(user)
    node = node_for(viewer, node_id)
    row = _node_rows([node], now=now)[0]
    deployments = list(node.deployments.select_related("model").order_by("-created_at")[:50])
    hw = node.hardware or {}
    return {
        **row,
        "hardware": hw,
        "gpus": hw.get("gpus") or [],
        "hardware_json": json.dumps(hw, indent=2, sort_keys=True, default=str),
        "telemetry_json": json.dumps(row["telemetry"], indent=2, sort_keys=True, default=str),
        "served": series.node_served(node_ids=[node.id])[str(node.id)],
        "lending_summary": _lending_summary(node, now),
        "earned_30d": sum(
            int(r["credits"])
            for r in credit_selectors.node_earnings(
                account_id=ids.account_id(node.account_id),
                days=30,
                node_id=ids.node_id(node.id),
                now=now,
            )
        ),
        "deployments": deployments,
        "is_staff": viewer.is_staff,
    }


def _state_counts(viewer: Viewer) -> dict[str, Any]:
    cap = node_selectors.cluster_capacity(account_id=viewer.scope)
    by_state = cap["by_state"]
    return {
        "capacity": cap,
        "state_counts": [(s, by_state.get(s, 0)) for s in NodeState.values],
        "node_total": sum(by_state.values()),
    }


# --- dashboard -----------------------------------------------------------------------------------


def _live_capacity(viewer: Viewer, cap: dict[str, Any]) -> dict[str, Any]:
    """Free and in-use figures, taking live telemetry (CPU load, free RAM) over enrolment-time values."""
    usable = _visible_nodes(viewer).filter(state__in=POOL)
    cores_busy = 0.0
    ram_free = 0
    for n in usable.only("id", "cpu_logical_cores", "ram_available"):
        tele = node_selectors.node_telemetry(node_id=ids.node_id(n.id))
        cores_busy += float(tele.get("cpu_percent") or 0.0) / 100.0 * (n.cpu_logical_cores or 0)
        ram_free += int(tele.get("mem_available") or n.ram_available or 0)
    cores = cap["cores"]
    return {
        "cores_total": cores,
        "cores_busy": round(cores_busy, 1),
        "cores_free": round(max(0.0, cores - cores_busy), 1),
        "ram_total": cap["ram_total"],
        "ram_free": min(ram_free, cap["ram_total"]) if cap["ram_total"] else ram_free,
        "ram_used": max(0, cap["ram_total"] - ram_free),
        "vram_total": cap["vram_total"],
        "vram_free": cap["vram_free"],
        "vram_used": max(0, cap["vram_total"] - cap["vram_free"]),
    }


def _tokens_now(viewer: Viewer, *, now: datetime) -> dict[str, Any]:
    """Throughput over the last minute (finished jobs) and the jobs generating right now; a
    contributor's count their own jobs and the jobs their machines served."""
    since = now - timedelta(seconds=TOKENS_WINDOW_SECONDS)
    jobs = (
        Job.objects.all()
        if viewer.is_staff
        else Job.objects.filter(
            Q(account_id=viewer.account_id)
            | Q(id__in=Job.objects.filter(nodes__account_id=viewer.account_id).values("id"))
        )
    )
    done = jobs.filter(state=JobState.COMPLETED, finished_at__gte=since).aggregate(
        tokens=Sum("completion_tokens"), rate=Avg("tokens_per_s")
    )
    tokens = int(done["tokens"] or 0)
    return {
        "tokens_per_s": round(tokens / TOKENS_WINDOW_SECONDS, 2),
        "per_job_tokens_per_s": round(float(done["rate"] or 0.0), 1),
        "running": jobs.filter(state__in=JOB_IN_FLIGHT).count(),
        "window": TOKENS_WINDOW_SECONDS,
    }


def _visible_deployments(viewer: Viewer) -> QuerySet[Deployment]:
    qs = job_selectors.deployment_list()
    if not viewer.is_staff:
        qs = qs.filter(nodes__account_id=viewer.account_id).distinct()
    return qs.prefetch_related("nodes")


def dashboard_stats(*, user: Any, now: datetime) -> dict[str, Any]:
    """The numbers panel (capacity and tokens/s), refreshed by itself every few seconds."""
    viewer = viewer_for(user)
    counts = _state_counts(viewer)
    return {
        **counts,
        "live": _live_capacity(viewer, counts["capacity"]),
        "tokens": _tokens_now(viewer, now=now),
        "is_staff": viewer.is_staff,
    }


def dashboard_page(*, user: Any, now: datetime) -> dict[str, Any]:
    viewer = viewer_for(user)
    stats = dashboard_stats(user=user, now=now)
    deployments = list(_visible_deployments(viewer).filter(state__in=list(DEPLOYMENT_ACTIVE))[:20])
    nodes = node_selectors.node_list(account_id=viewer.scope)
    return {
        **stats,
        "rows": _node_rows(nodes, now=now),
        "deployments": deployment_rows(deployments, viewer)[0],
        "events": node_selectors.event_list(limit=15, account_id=viewer.scope),
    }


# --- tokens, models, deployments --------------------------------------------------------------


def token_list_page(*, now: datetime) -> dict[str, Any]:
    tokens = list(EnrollmentToken.objects.select_related("account")[:200])
    return {
        "tokens": [{"token": t, "status": node_selectors.token_status(t, now=now)} for t in tokens]
    }


def model_list_page() -> dict[str, Any]:
    return {"models": list(Model.objects.prefetch_related("files__replicas").order_by("name"))}


def deployment_rows(
    deps: list[Deployment], viewer: Viewer | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows for these deployments and a summary per model that has replicas (slots, queue),
    from one read of admission's figures."""
    load = job_selectors.replica_load(deployments=deps)
    measured = series.deployment_measured_tps(
        deployment_ids=[d.id for d in deps], since=timezone.now() - timedelta(hours=1)
    )
    rows = [deployment_row(d, viewer, load=load, measured=measured) for d in deps]
    names = {str(d.model_id): d.model.name for d in deps}
    models = [
        {"model": names[mid], **vars(m)}
        for mid, m in sorted(load[2].items(), key=lambda kv: names.get(kv[0], ""))
        if m.replicas and mid in names
    ]
    return rows, models


def deployment_row(
    dep: Deployment,
    viewer: Viewer | None = None,
    load: Any = None,
    measured: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One deployment's row: nodes (as this viewer may see them, linked), predicted and measured
    tokens/s, slots and queue, and a failure's summary, cause and next step."""
    if load is None:
        load = job_selectors.replica_load(deployments=[dep])
    if measured is None:
        measured = series.deployment_measured_tps(
            deployment_ids=[dep.id], since=timezone.now() - timedelta(hours=1)
        )
    in_use, waiting, _ = load
    plan = dep.plan or {}
    # The KV cache coordinator's record: conversations its slots hold, and their memory
    # (tokens × the model's KV bytes per token).
    convs, kv_tokens = (
        kvcache.deployments_held([dep.id]).get(str(dep.id), (0, 0))
        if dep.state in DEPLOYMENT_ACTIVE
        else (0, 0)
    )
    nodes = list(dep.nodes.all())
    primary = str(dep.primary_id or plan.get("primary_node_id") or "")
    layers: dict[str, int] = {}
    for d in plan.get("devices") or []:
        layers[str(d["node_id"])] = layers.get(str(d["node_id"]), 0) + max(
            0, int(d.get("layer_end", 0)) - int(d.get("layer_start", 0))
        )
    shown = nodes
    if viewer is not None and not viewer.is_staff:
        shown = [n for n in nodes if n.account_id == viewer.account_id]
    links = [
        {
            "id": str(n.id),
            "name": n.name,
            "primary": str(n.id) == primary,
            "layers": layers.get(str(n.id)),
        }
        for n in shown
    ]
    names = [n.name for n in shown]
    others = len(nodes) - len(shown)
    if others:
        # A contributor sees their own nodes by name and only a count of everyone else's.
        names.append(f"+{others} other node{'s' if others > 1 else ''}")
    return {
        "dep": dep,
        "node_names": names,
        "node_links": links,
        "other_nodes": others,
        "failure": failure_explained(dep.error) if dep.state in DEPLOYMENT_ENDED else None,
        "ended": dep.state in DEPLOYMENT_ENDED,
        "measured_tps": measured.get(str(dep.id)),
        "predicted_tps": plan.get("predicted_tokens_per_s"),
        "active": dep.state in DEPLOYMENT_ACTIVE,
        "slots_in_use": in_use.get(str(dep.id), 0),
        "queue_depth": waiting.get(str(dep.id), 0),
        "kv_conversations": convs,
        "kv_bytes": kv_tokens * kvcache.kv_bytes_per_token(dep.model_file),
    }


def deployment_list_page(*, user: Any) -> dict[str, Any]:
    viewer = viewer_for(user)
    rows, replicas = deployment_rows(list(_visible_deployments(viewer)[:200]), viewer)
    ended: dict[str, int] = {}
    for r in rows:
        if r["ended"]:
            ended[r["dep"].state] = ended.get(r["dep"].state, 0) + 1
    return {
        "ended_counts": sorted(ended.items()),
        "ended_total": sum(ended.values()),
        "deployments": rows,
        "replicas": replicas,
        "models": list(Model.objects.filter(files__isnull=False).distinct().order_by("name")),
        "nodes": node_selectors.node_list(),
        "is_staff": viewer.is_staff,
        "default_n_ctx": 2048,
    }


def deployment_detail(*, deployment_id: DeploymentId) -> Deployment:
    dep = job_selectors.deployment_list().filter(pk=deployment_id).first()
    if dep is None:
        raise Http404("no such deployment")
    return dep


def explanation(plan: dict[str, Any]) -> list[str]:
    """The scheduler's reasons, with node ids replaced by the names an operator knows."""
    ids = {d["node_id"] for d in plan.get("devices", [])} | (
        {plan["primary_node_id"]} if plan.get("primary_node_id") else set()
    )
    names = {nid: job_selectors.node_name(nid) for nid in ids}
    out = []
    for line in plan.get("explanation") or []:
        for nid, name in names.items():
            line = line.replace(nid, name)
        out.append(line)
    return out


def placement_bar(plan: dict[str, Any], *, n_layer: int) -> dict[str, Any]:
    """Cells for the layer bar: one per layer, coloured by the node that holds it, plus a legend."""
    colour_of: dict[str, str] = {}
    legend: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = [
        {"layer": i, "node": "", "colour": "", "device": ""} for i in range(n_layer)
    ]
    for d in plan.get("devices", []):
        nid = d["node_id"]
        name = d.get("node_name") or job_selectors.node_name(nid)
        if nid not in colour_of:
            colour_of[nid] = NODE_COLOURS[len(colour_of) % len(NODE_COLOURS)]
            legend.append(
                {
                    "node": name,
                    "colour": colour_of[nid],
                    "layers": 0,
                    "memory_bytes": 0,
                    "devices": [],
                }
            )
        entry = next(e for e in legend if e["colour"] == colour_of[nid])
        entry["layers"] += int(d.get("n_layers") or (d["layer_end"] - d["layer_start"]))
        entry["memory_bytes"] += int(d.get("memory_bytes") or 0)
        entry["devices"].append(
            f"{d['device']} {d['layer_start']}–{d['layer_end'] - 1}"
            if d["layer_end"] > d["layer_start"]
            else d["device"]
        )
        for i in range(max(0, d["layer_start"]), min(n_layer, d["layer_end"])):
            cells[i] = {"layer": i, "node": name, "colour": colour_of[nid], "device": d["device"]}
    # Layers no device lists stay on the primary's CPU (n_gpu_layers below n_layer).
    primary = plan.get("primary_node_id")
    if primary and any(not c["node"] for c in cells):
        name = job_selectors.node_name(primary)
        colour = colour_of.get(primary) or NODE_COLOURS[len(colour_of) % len(NODE_COLOURS)]
        for c in cells:
            if not c["node"]:
                c.update(node=name, colour=colour, device="CPU")
    return {"cells": cells, "legend": legend}


# --- jobs ------------------------------------------------------------------------------------------


def job_list_page(*, user: Any, state: str = "", model: str = "", node: str = "") -> dict[str, Any]:
    viewer = viewer_for(user)
    node_id = None
    if node:
        found = _visible_nodes(viewer).filter(Q(name=node)).values_list("id", flat=True).first()
        node_id = ids.node_id(
            found if found is not None else "00000000-0000-0000-0000-000000000000"
        )
    qs = job_selectors.job_list(state=state or None, model=model or None, node_id=node_id)
    if not viewer.is_staff:
        qs = qs.filter(_served_by(viewer))
    return {
        "jobs": list(qs.prefetch_related("nodes")[:200]),
        "states": JobState.values,
        "models": list(Model.objects.order_by("name").values_list("name", flat=True)),
        "filters": {"state": state, "model": model, "node": node},
        "is_staff": viewer.is_staff,
    }


def _served_by(viewer: Viewer) -> Q:
    """A contributor's jobs: their own, and those their machines served (they see who asked for
    nothing, and the prompt only when it is theirs: ``job_detail_page``)."""
    return Q(account_id=viewer.account_id) | Q(
        id__in=Job.objects.filter(nodes__account_id=viewer.account_id).values("id")
    )


def job_for(viewer: Viewer, job_id: JobId, *, served: bool = False) -> Job:
    """The job if it is this viewer's (staff: any); ``served`` also admits the jobs the viewer's
    machines served. 404 otherwise."""
    qs = Job.objects.select_related("model", "deployment")
    if not viewer.is_staff:
        qs = qs.filter(_served_by(viewer) if served else Q(account_id=viewer.account_id))
    job = qs.filter(pk=job_id).first()
    if job is None:
        raise Http404("no such job")
    return job


def job_detail_page(*, user: Any, job_id: JobId) -> dict[str, Any]:
    viewer = viewer_for(user)
    job = job_for(viewer, job_id, served=True)
    # The prompt and the answer are the requester's (and the operator's): a contributor whose
    # machine only served the job sees its figures and nodes, not its text.
    own = viewer.is_staff or job.account_id == viewer.account_id

    def ms(a: Any, b: Any) -> float | None:
        return round((b - a).total_seconds() * 1000, 1) if a and b else None

    placement = (job.placement or {}).get("devices") or []
    attempts: list[dict[str, Any]] = []
    for a in JobAttempt.objects.filter(job_id=job.id).select_related("primary").order_by("number"):
        devices = (a.plan or {}).get("devices") or []
        attempts.append(
            {
                "attempt": a,
                "devices": [
                    {
                        "node_id": d["node_id"],
                        "node": d.get("node_name") or job_selectors.node_name(d["node_id"]),
                        "device": d.get("device", ""),
                        "layers": [d.get("layer_start", 0), d.get("layer_end", 0)],
                    }
                    for d in devices
                ],
            }
        )
    nodes = list(job.nodes.all())
    # Every node that took part: the job's, and each attempt's plan's (a failover's earlier nodes).
    named = (
        {str(n.id) for n in nodes}
        | {str(d["node_id"]) for a in attempts for d in a["devices"]}
        | {str(d.get("node_id")) for d in placement if d.get("node_id")}
    )
    visible = (
        named
        if viewer.is_staff
        else {
            str(pk)
            for pk in Node.objects.filter(pk__in=named, account_id=viewer.account_id).values_list(
                "id", flat=True
            )
        }
    )
    return {
        "job": job,
        "attempts": attempts,
        "visible_nodes": visible,
        "node_links": [(str(n.id), n.name) for n in nodes if str(n.id) in visible],
        "failure": failure_explained(job.error) if job.error else None,
        "timings": [
            ("Queued → dispatched", ms(job.queued_at, job.dispatched_at)),
            ("Queued → first token", ms(job.queued_at, job.first_token_at)),
            ("Total", ms(job.queued_at, job.finished_at)),
            ("Runtime TTFT", job.ttft_ms),
        ],
        "placement": placement,
        "node_names": [n.name for n in job.nodes.all()],
        "events": node_selectors.event_list(job_id=ids.job_id(job.id), limit=100),
        "live": job.state in JOB_OPEN,
        "messages_json": json.dumps((job.params or {}).get("messages") or [], indent=2)[:4000]
        if own
        else "",
        "own": own,
        "is_staff": viewer.is_staff,
    }


# --- credits -------------------------------------------------------------------------------------


def credits_page(*, user: Any, account: str | None, now: datetime) -> dict[str, Any]:
    viewer = viewer_for(user)
    account_id = viewer.account_id
    if account and viewer.is_staff:
        found = (
            Account.objects.filter(pk=account).values_list("id", flat=True).first()
            if _is_uuid(account)
            else None
        )
        if found is None:
            raise Http404("no such account")
        account_id = ids.account_id(found)
    summary = credit_selectors.account_summary(account_id=account_id, now=now)
    # Staff looking at their own account see every receipt; otherwise the account's own.
    receipts_scope = None if (viewer.is_staff and not account) else account_id
    receipts = list(
        credit_selectors.receipt_list(account_id=receipts_scope).select_related("node")[:100]
    )
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    for r in receipts:
        t = totals.setdefault(
            (r.node.name, r.model_name),
            {"node": r.node.name, "model": r.model_name, "count": 0, "credits": 0},
        )
        t["count"] += 1
        t["credits"] += int(r.credits)
    return {
        "summary": summary,
        "ledger": list(credit_selectors.ledger_postings(account_id=account_id)[:100]),
        "receipts": receipts,
        "receipt_summary": sorted(totals.values(), key=lambda t: (-t["credits"], t["node"])),
        "accounts": list(person_accounts()) if viewer.is_staff else [],
        "selected_account": str(account_id),
        "is_staff": viewer.is_staff,
        "operator_accounts": [str(a) for a in operator_account_ids()] if viewer.is_staff else [],
    }


def receipt_for(*, user: Any, receipt_id: uuid.UUID | str) -> Receipt:
    viewer = viewer_for(user)
    receipt = credit_selectors.receipt_list(account_id=viewer.scope).filter(pk=receipt_id).first()
    if receipt is None:
        raise Http404("no such receipt")
    return receipt


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(str(value))
        return True
    except ValueError:
        return False


# --- playground ------------------------------------------------------------------------------------


def playground_page() -> dict[str, Any]:
    ready = job_selectors.deployment_list(state=DeploymentState.READY).values_list(
        "model__name", flat=True
    )
    served = sorted(set(ready))
    others = [
        m
        for m in Model.objects.filter(files__isnull=False)
        .distinct()
        .order_by("name")
        .values_list("name", flat=True)
        if m not in served
    ]
    return {"served": served, "others": others}


# --- a contributor's machines ----------------------------------------------------------------------


OPERATOR_ACCOUNT = "system:operator"


def operator_account_ids() -> list[Any]:
    """The account the operator's own machines earn into (nodes enrolled with the operator key)."""
    return list(Account.objects.filter(name=OPERATOR_ACCOUNT).values_list("id", flat=True))


def person_accounts() -> QuerySet[Account]:
    """Accounts a person may pick: people's, plus the operator's machines; never the ledger's own
    system accounts (mint, escrow, holds, fees)."""
    return Account.objects.filter(~Q(kind=AccountKind.SYSTEM) | Q(name=OPERATOR_ACCOUNT)).order_by(
        "name"
    )


def _lending_summary(node: Node, now: datetime) -> dict[str, Any]:
    view = lending_view(lending=node.lending, now=now)
    caps = [
        f"{label} ≤ {value}"
        for label, value in (
            ("RAM", _bytes(view.ram_bytes)),
            ("VRAM", _bytes(view.vram_bytes)),
            ("threads", view.threads),
        )
        if value
    ]
    has_policy = bool((node.lending or {}).get("policy"))
    if view.paused:
        status = "paused by the owner"
    elif not view.open:
        status = "outside its lending window"
    elif view.closes_in is not None:
        status = f"lent now; the window closes in {int(view.closes_in // 60)} min"
    else:
        status = "lent now" if has_policy else "lent fully, always (no policy set)"
    return {"status": status, "caps": caps, "open": view.open and not view.paused}


def _bytes(n: int | None) -> str | None:
    if not n:
        return None
    return f"{n / 2**30:.1f} GiB"


def machines_panel(*, viewer: Viewer, now: datetime) -> dict[str, Any]:
    """The viewer's machines (an operator's: theirs and the operator account's): state, what each
    served, its lending policy in force, credits earned in 30 days; and the account's standing."""
    accounts = [viewer.account_id]
    if viewer.is_staff:
        accounts += operator_account_ids()
    nodes = list(Node.objects.filter(account_id__in=accounts).order_by("name"))
    served = series.node_served(node_ids=[n.id for n in nodes])
    earned: dict[str, int] = {}
    for account_id in accounts:
        for r in credit_selectors.node_earnings(account_id=account_id, days=30, now=now):
            earned[r["node"]] = earned.get(r["node"], 0) + int(r["credits"])
    machines = [
        {
            "node": n,
            "served": served.get(str(n.id), {"jobs": 0, "tokens": 0, "models": []}),
            "lending": _lending_summary(n, now),
            "earned_30d": earned.get(str(n.id), 0),
        }
        for n in nodes
    ]
    # Standing in the queue: the figure admission orders waiting jobs by (credits.selectors), and
    # where it ranks among people's accounts.
    people = list(Account.objects.exclude(kind=AccountKind.SYSTEM).values_list("id", flat=True))
    standing = credit_selectors.account_standing(account_ids=people + [viewer.account_id], now=now)
    summary = credit_selectors.account_summary(account_id=viewer.account_id, now=now)
    mine = summary.get("standing", standing.get(viewer.account_id, 0))
    rank = 1 + sum(1 for a in people if a != viewer.account_id and standing.get(a, 0) > mine)
    return {
        "machines": machines,
        "standing": mine,
        # Seconds a waiting request of this account goes ahead, where admission says (issue 28).
        "priority_seconds": summary.get("priority_seconds"),
        "standing_rank": rank,
        "standing_of": max(len(set(people) | {viewer.account_id}), 1),
        "earned_30d": sum(earned.values()),
        "standing_window_hours": round(settings.CREDITS_STANDING_WINDOW_SECONDS / 3600, 1),
    }


# --- live rows (the dashboard consumer) --------------------------------------------------------


def render_node_row(*, user: Any, node_id: NodeId) -> str:
    """The node's row, badge and actions plus the per-state counts, each marked hx-swap-oob.

    Pages hold whichever of these they show; racon.js drops the rest and appends a row that is not
    on the page yet (a node that just enrolled). Returns "" when this user may not see the node.
    """
    if not user or not user.is_authenticated:
        return ""
    viewer = viewer_for(user)
    node = _visible_nodes(viewer).filter(pk=node_id).first()
    if node is None:
        return ""
    row = _node_rows([node], now=timezone.now())[0]
    ctx = {**row, "oob": True, "is_staff": viewer.is_staff, **_state_counts(viewer)}
    return "".join(
        render_to_string(f"ui/nodes/list.html#{name}", ctx)
        for name in ("node-row", "node-badge", "node-actions")
    ) + render_to_string("ui/dashboard.html#node-states", ctx)


def render_deployment_row(*, user: Any, deployment_id: DeploymentId) -> str:
    """The deployment's row (hx-swap-oob), or "" when this user may not see it."""
    if not user or not user.is_authenticated:
        return ""
    viewer = viewer_for(user)
    dep = _visible_deployments(viewer).filter(pk=deployment_id).first()
    if dep is None:
        return ""
    ctx = {**deployment_row(dep, viewer), "oob": True, "is_staff": viewer.is_staff}
    return render_to_string("ui/deployments/list.html#dep-row", ctx)


_ = (timezone, Receipt)
