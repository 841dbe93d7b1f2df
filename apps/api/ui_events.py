"""The event feed with meaning: runs of job events and of BUSY⇄READY flips summarised into one line
each, every node, model, job and deployment named and linked (never a bare id), and filters by kind
and node. Reads only (``node_selectors.event_list``); the dashboard, a node's page and /events/
show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q

from apps.jobs.models import Deployment, Job
from apps.nodes import selectors as node_selectors
from apps.nodes.models import Event, Node
from racon import ids
from racon.ids import JobId, NodeId

from .ui_render import Viewer, _visible_nodes

KINDS = {
    "": "every kind",
    "jobs": "jobs",
    "states": "node states",
    "deployments": "deployments and models",
    "problems": "failures and security",
}
_PROBLEM = re.compile(r"FAIL|TIMEOUT|VIOLATION|REFUSED|REVOKED|ERROR|FAULT|LOST|PARTITION|CLAMPED")
_FLIP = {"BUSY", "READY"}
_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
_DEPLOYMENT_ID = re.compile(r"\b(?:deployment|replacement|replica) (" + _UUID.pattern + ")")
SCAN = 400  # events read to build one page of the feed


def kind_group(e: Event) -> str:
    if e.kind.startswith("JOB_"):
        return "jobs"
    if e.kind == "NODE_STATE_CHANGED":
        return "states"
    if _PROBLEM.search(e.kind):
        return "problems"
    if e.kind.startswith(("DEPLOYMENT_", "REPLICA_", "PLAN_", "PRIMARY_", "MODEL_", "KV_", "RPC_")):
        return "deployments"
    return ""


@dataclass
class FeedItem:
    kind: str
    group: str
    at: datetime
    first_at: datetime
    text: str = ""
    count: int = 1
    tone: str = "info"
    nodes: dict[str, str] = field(default_factory=dict)  # id → name
    models: list[str] = field(default_factory=list)
    jobs: list[tuple[str, str]] = field(default_factory=list)  # (id, label)
    deployment: tuple[str, str] | None = None  # (id, label)
    outcomes: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    state: str = ""  # a run of flips: the node's newest state


def _job_label(job: Job | None, job_id: JobId) -> str:
    model = job.model.name if job is not None and job.model_id else "job"
    return f"{model} · {str(job_id)[:8]}"


def _deployment_label(dep: Deployment | None) -> str:
    return f"{dep.model.name} deployment" if dep is not None else "a deployment"


def _names_for(wanted: set[str]) -> dict[str, str]:
    """Readable names for the ids a message mentions: nodes by name, deployments and jobs by model."""
    if not wanted:
        return {}
    out = {str(n.id): n.name for n in Node.objects.filter(pk__in=wanted).only("id", "name")}
    for d in (
        Deployment.objects.filter(pk__in=wanted).select_related("model").only("id", "model__name")
    ):
        out[str(d.id)] = f"{d.model.name} deployment"
    for j in Job.objects.filter(pk__in=wanted).select_related("model").only("id", "model__name"):
        out[str(j.id)] = _job_label(j, ids.job_id(j.id))
    return out


def readable(text: str, names: dict[str, str]) -> str:
    """The message with each id it names replaced by that thing's name (an unknown id is cut short)."""

    def dep(m: re.Match[str]) -> str:
        word = m.group(0).split(" ", 1)[0]
        name = names.get(m.group(1))
        if name is None:
            return m.group(0)
        return name if word == "deployment" else f"{word} {name}"

    text = _DEPLOYMENT_ID.sub(dep, text or "")
    return _UUID.sub(lambda m: names.get(m.group(0), m.group(0)[:8] + "…"), text)


def names_in(text: str) -> str:
    """``text`` with the ids it names replaced by names (one query per kind of thing)."""
    ids = set(_UUID.findall(text or ""))
    return readable(text, _names_for(ids)) if ids else text


def _tone(e: Event) -> str:
    if _PROBLEM.search(e.kind):
        return "bad"
    if e.kind.endswith(("READY", "COMPLETED", "DONE", "LOADED", "VERIFIED", "ENROLLED")):
        return "ok"
    return "info"


def _job_summary(item: FeedItem) -> str:
    jobs = len(item.jobs)
    head = f"{jobs} job{'s' if jobs != 1 else ''}"
    if len(item.outcomes) == 1:
        head += " " + next(iter(item.outcomes)).lower()
    elif item.outcomes:
        head += ": " + ", ".join(f"{n} {k.lower()}" for k, n in sorted(item.outcomes.items()))
    return head + (f" · {item.tokens:,} tokens" if item.tokens else "")


def event_feed(
    *,
    viewer: Viewer,
    kind: str = "",
    node: str = "",
    limit: int = 20,
    node_id: NodeId | None = None,
) -> dict[str, Any]:
    """The newest ``limit`` feed lines for this viewer, filtered by kind group and node name."""
    kind = kind if kind in KINDS else ""
    nodes = list(_visible_nodes(viewer).order_by("name").only("id", "name"))
    if node and node_id is None:
        node_id = next(
            (ids.node_id(n.id) for n in nodes if n.name == node or str(n.id) == node), None
        )
        if node_id is None:
            return {
                "items": [],
                "limit": limit,
                "kinds": KINDS,
                "kind": kind,
                "node": node,
                "nodes": nodes,
            }
    if node_id is not None:
        # A node's events, and the job events of the jobs it served (a job's events name no node).
        served_by_node = Job.objects.filter(nodes=ids.as_uuid(node_id)).values("id")
        events = list(
            Event.objects.filter(Q(node_id=node_id) | Q(job_id__in=served_by_node)).order_by(
                "-created_at", "-id"
            )[:SCAN]
        )
    elif viewer.is_staff:
        events = node_selectors.event_list(limit=SCAN)
    else:
        # A contributor's: their nodes' events, and the job events of the jobs those nodes served
        # (a job's events name no node) or that they asked for.
        acct = viewer.account_id
        served = Job.objects.filter(Q(nodes__account_id=acct) | Q(account_id=acct)).values("id")
        events = list(
            Event.objects.filter(Q(node__account_id=acct) | Q(job_id__in=served)).order_by(
                "-created_at", "-id"
            )[:SCAN]
        )
    if kind:
        events = [e for e in events if kind_group(e) == kind]
    # Names for every node, job and deployment these events refer to, in a few queries.
    job_ids = {e.job_id for e in events if e.job_id}
    dep_ids = {e.deployment_id for e in events if e.deployment_id}
    jobs = {
        j.id: j
        for j in Job.objects.filter(pk__in=job_ids)
        .select_related("model")
        .prefetch_related("nodes")
    }
    visible = {str(n.id) for n in nodes}
    deps = {d.id: d for d in Deployment.objects.filter(pk__in=dep_ids).select_related("model")}
    node_names = {
        str(n.id): n.name
        for n in Node.objects.filter(pk__in={e.node_id for e in events if e.node_id})
    }
    mentioned = {m for e in events for m in _UUID.findall(e.message or "")}
    names = {**_names_for(mentioned - set(node_names)), **node_names}
    items: list[FeedItem] = []
    # An activity run: consecutive job events and BUSY⇄READY flips, however interleaved, make one
    # jobs line and one flips line per node; any other event ends the run.
    run_jobs: FeedItem | None = None
    run_flips: dict[str, FeedItem] = {}
    for e in events:  # newest first
        group = kind_group(e)
        if group == "jobs":
            job = jobs.get(e.job_id) if e.job_id else None
            last = run_jobs
            if last is None:
                last = run_jobs = FeedItem(
                    kind="JOBS", group="jobs", at=e.created_at, first_at=e.created_at, tone="ok"
                )
                items.append(last)
            else:
                last.count += 1
            last.first_at = e.created_at
            if e.job_id and all(jid != str(e.job_id) for jid, _ in last.jobs):
                last.jobs.append((str(e.job_id), _job_label(job, ids.job_id(e.job_id))))
                if job is not None:
                    last.outcomes[job.state] = last.outcomes.get(job.state, 0) + 1
                    last.tokens += job.completion_tokens
                    if job.model.name not in last.models:
                        last.models.append(job.model.name)
                    if job.state == "FAILED":
                        last.tone = "bad"
            if e.node_id:
                last.nodes[str(e.node_id)] = names.get(str(e.node_id), "node")
            for n in job.nodes.all() if job is not None else []:
                if str(n.id) in visible:  # a contributor is not told others' node names
                    last.nodes[str(n.id)] = n.name
            last.text = _job_summary(last)
            continue
        if group == "states" and {e.old_state, e.new_state} <= _FLIP and e.node_id:
            nid = str(e.node_id)
            flips = run_flips.get(nid)
            if flips is not None:
                flips.count += 1
                flips.first_at = e.created_at
                flips.text = f"went BUSY⇄READY {flips.count} times · now {flips.state}"
                continue
            flips = run_flips[nid] = FeedItem(
                kind="FLIPS", group="states", at=e.created_at, first_at=e.created_at, tone="busy"
            )
            flips.nodes[nid] = names.get(nid, "node")
            flips.state = e.new_state
            flips.text = f"{e.old_state} → {e.new_state}"
            items.append(flips)
            continue
        run_jobs, run_flips = None, {}
        item = FeedItem(
            kind=e.kind, group=group, at=e.created_at, first_at=e.created_at, tone=_tone(e)
        )
        if e.node_id:
            item.nodes[str(e.node_id)] = names.get(str(e.node_id), "node")
        if e.deployment_id:
            dep = deps.get(e.deployment_id)
            item.deployment = (str(e.deployment_id), _deployment_label(dep))
            if dep is not None:
                item.models.append(dep.model.name)
        if e.job_id:
            item.jobs.append((str(e.job_id), _job_label(jobs.get(e.job_id), ids.job_id(e.job_id))))
        item.text = readable(e.message, names) or (
            f"{e.old_state} → {e.new_state}" if e.old_state or e.new_state else ""
        )
        items.append(item)
    for it in items:
        it.jobs = it.jobs[:6]
    return {
        "items": items[:limit],
        "limit": limit,
        "kinds": KINDS,
        "kind": kind,
        "node": node,
        "nodes": nodes,
    }
