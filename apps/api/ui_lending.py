"""Web UI for contributors' terms and pay: the node's lending policy form and the earnings page.

The form is the policy file's shape (agent/lending.py): the controller checks it with the agent's
own rules (apps/nodes/lending.py), stores it, and pushes it to the agent as a ``set_lending``
command; an error names the field it is about. Only the node's owner or staff get here
(``ui_render.node_for``: anyone else gets 404). Earnings are ``credits.selectors.node_earnings``,
the same rows as GET /api/credits/earnings and ``racon credits earnings``.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods

from agent.lending import HANDOFFS, GiB, PolicyError
from apps.api import ui_charts, ui_render
from apps.api.ui_views import render_ui
from apps.credits import selectors as credit_selectors
from apps.nodes.commands import command_send
from apps.nodes.lending import node_lending_owner_set
from apps.nodes.models import Node
from racon import ids
from racon.ids import NodeId

FIELDS = (
    "timezone",
    "windows",
    "handoff",
    "idle_minutes",
    "cpu_below",
    "ram_gb",
    "vram_gb",
    "threads",
)
# PolicyError.field (the document's name for it) → the form's input.
_ERROR_FIELD = {
    "idle.minutes": "idle_minutes",
    "idle.cpu_below": "cpu_below",
    "caps.ram_gb": "ram_gb",
    "caps.vram_gb": "vram_gb",
    "caps.threads": "threads",
}
EARNINGS_DAYS = (7, 30, 90, 366)


def form_field(error: PolicyError) -> str:
    """The form input a PolicyError is about (``windows[2]`` → ``windows``)."""
    name = error.field
    if name.startswith("windows"):
        return "windows"
    return _ERROR_FIELD.get(name, name if name in FIELDS else "")


def lending_document(form: dict[str, str]) -> dict[str, Any]:
    """The form's values as a policy file's document (policy_from_document reads it)."""
    windows = [w.strip() for w in form.get("windows", "").replace(";", "\n").splitlines()]
    return {
        "timezone": form.get("timezone", "").strip() or None,
        "windows": [w for w in windows if w],
        "handoff": form.get("handoff", "").strip() or None,
        "idle": {
            "minutes": form.get("idle_minutes", "").strip() or None,
            "cpu_below": form.get("cpu_below", "").strip() or None,
        },
        "caps": {
            "ram_gb": form.get("ram_gb", "").strip() or None,
            "vram_gb": form.get("vram_gb", "").strip() or None,
            "threads": form.get("threads", "").strip() or None,
        },
    }


def _g(value: Any) -> str:
    return "" if value is None else f"{value:g}"


def form_values(wire: dict[str, Any] | None) -> dict[str, str]:
    """A stored policy (the wire form) as the form shows it: sizes in GB, one window a line."""
    wire = wire or {}
    caps = wire.get("caps") or {}
    return {
        "timezone": str(wire.get("timezone") or "UTC"),
        "windows": "\n".join(wire.get("windows") or []),
        "handoff": str(wire.get("handoff") or "failover"),
        "idle_minutes": _g(wire.get("idle_minutes")),
        "cpu_below": _g(wire.get("cpu_below")),
        "ram_gb": _g(caps["ram_bytes"] / GiB) if caps.get("ram_bytes") else "",
        "vram_gb": _g(caps["vram_bytes"] / GiB) if caps.get("vram_bytes") else "",
        "threads": str(caps.get("threads") or ""),
    }


def _lending_context(node: Node, **extra: Any) -> dict[str, Any]:
    lending = node.lending or {}
    return {
        "node": node,
        "lending": lending,
        "owner_set": lending.get("owner") or {},
        "paused": lending.get("paused") or {},
        "values": form_values(lending.get("policy")),
        "handoffs": HANDOFFS,
        "ram_gb_total": round((node.hardware or {}).get("memory", {}).get("total", 0) / GiB, 1),
        **extra,
    }


@login_required
@require_http_methods(["GET", "POST"])
def node_lending(request: HttpRequest, node_id: NodeId) -> HttpResponse:
    """GET: the node's lending policy and its form. POST: set it (owner or staff)."""
    node = ui_render.node_for(ui_render.viewer_for(request.user), node_id)  # 404 for others
    if request.method == "GET":
        return render_ui(
            request, "ui/nodes/lending.html", _lending_context(node), partial="lending-form"
        )
    form = {k: str(request.POST.get(k, "")) for k in FIELDS}

    def push(wire: dict[str, Any]) -> None:
        command_send(node_id=ids.node_id(node.id), kind="set_lending", payload={"lending": wire})

    try:
        node_lending_owner_set(
            node_id=ids.node_id(node.id),
            policy=lending_document(form),
            now=timezone.now(),
            by=request.user.get_username(),
            push=push,
        )
    except PolicyError as exc:
        ctx = _lending_context(
            node, values=form, error=str(exc), error_field=form_field(exc) or "form"
        )
        return render_ui(request, "ui/nodes/lending.html", ctx, partial="lending-form", status=422)
    node.refresh_from_db()
    ctx = _lending_context(node, saved=True)
    return render_ui(request, "ui/nodes/lending.html", ctx, partial="lending-form")


# --- earnings --------------------------------------------------------------------------------


class BadParam(ValueError):
    """A query parameter of the earnings page is wrong; the message names it."""


def _days(raw: str | None) -> int:
    try:
        value = int(raw) if raw else 30
    except ValueError:
        raise BadParam(f"days: must be a whole number, got {raw!r}") from None
    if value not in EARNINGS_DAYS:
        raise BadParam(f"days: must be one of {', '.join(map(str, EARNINGS_DAYS))}, got {value}")
    return value


def _uuid(value: str, name: str) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise BadParam(f"{name}: must be an id, got {value!r}") from None


def earnings_page_context(
    *, user: Any, account: str | None, node: str | None, days: int
) -> dict[str, Any]:
    """Per node and day (UTC): credits, jobs and receipts of the viewer's account (staff: any
    account's), with totals per node and overall."""
    viewer = ui_render.viewer_for(user)
    account_id = viewer.account_id
    if account and not viewer.is_staff and _uuid(account, "account") != str(account_id):
        raise Http404("no such account")  # a contributor sees only their own
    # An operator's own view covers the machines they enrolled with the operator key as well
    # (those earn into the operator account, which is theirs to see).
    accounts = [account_id] + (ui_render.operator_account_ids() if viewer.is_staff else [])
    if account and viewer.is_staff:
        found = (
            ui_render.person_accounts()
            .filter(pk=_uuid(account, "account"))
            .values_list("id", flat=True)
            .first()
        )
        if found is None:
            raise Http404("no such account")
        account_id, accounts = ids.account_id(found), [found]
    nodes = list(Node.objects.filter(account_id__in=accounts).order_by("name"))
    node_id = None
    if node:
        wanted = _uuid(node, "node")
        node_id = next((ids.node_id(n.id) for n in nodes if str(n.id) == wanted), None)
        if node_id is None:
            raise Http404("no such node of this account")
    rows = sorted(
        (
            r
            for a in accounts
            for r in credit_selectors.node_earnings(account_id=a, days=days, node_id=node_id)
        ),
        key=lambda x: (x["day"], x["node_name"]),
        reverse=True,
    )
    per_node: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = per_node.setdefault(
            r["node"], {"node_name": r["node_name"], "credits": 0, "jobs": 0, "receipts": 0}
        )
        for k in ("credits", "jobs", "receipts"):
            t[k] += r[k]
    return {
        "rows": rows,
        "per_node": sorted(per_node.values(), key=lambda t: str(t["node_name"])),
        "total": {k: sum(r[k] for r in rows) for k in ("credits", "jobs", "receipts")},
        "days": days,
        "day_choices": EARNINGS_DAYS,
        "nodes": nodes,
        "selected_node": str(node_id) if node_id else "",
        "accounts": list(ui_render.person_accounts()) if viewer.is_staff else [],
        "selected_account": str(account_id) if account else "",
        "own_accounts": [str(a) for a in accounts],
        "is_staff": viewer.is_staff,
        "charts": ui_charts.earnings_chart(
            viewer=viewer, now=timezone.now(), days=days, accounts=accounts, node=node_id
        ),
    }


@login_required
@require_GET
def earnings_page(request: HttpRequest) -> HttpResponse:
    """Earnings per node and day; a bad parameter is a 400 naming it."""
    q = request.GET
    try:
        ctx = earnings_page_context(
            user=request.user,
            account=q.get("account"),
            node=q.get("node"),
            days=_days(q.get("days")),
        )
    except BadParam as exc:
        return HttpResponseBadRequest(str(exc), content_type="text/plain")
    return render_ui(request, "ui/earnings.html", ctx, partial="earnings-table")
