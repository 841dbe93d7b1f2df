"""What a node may read and set about itself with its own credential (issue 31: the desktop app).

Under /api/agent/ with the other node-credential endpoints; no account login opens them, and a
node sees only itself:

- GET  /api/agent/self      its state as the controller has it, what it lends, jobs served today;
- GET  /api/agent/earnings  its earnings per UTC day: the rows of GET /api/credits/earnings?node=
  (``credits.selectors.node_earnings``), so the figures are the same;
- GET  /api/agent/lending   its lending policy (the wire form and the web form's values);
- PUT  /api/agent/lending   set it: the web UI's form fields (/nodes/<id>/lending), checked by the
  same code (``apps.nodes.lending.node_lending_owner_set``) with the same error texts, and pushed
  to the agent as a ``set_lending`` command. A refusal is 422 naming the form field.

It lives in apps.api because it joins nodes (the credential, the policy) and credits (earnings),
and reuses the web form's mapping (apps/api/ui_lending.py).
"""

from __future__ import annotations

from datetime import UTC, datetime, time
from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agent.lending import PolicyError
from apps.api.ui_lending import FIELDS, form_field, form_values, lending_document
from apps.credits import selectors as credit_selectors
from apps.jobs.models import Job
from apps.nodes.api import node_or_401
from apps.nodes.commands import command_send
from apps.nodes.lending import lending_view, node_lending_owner_set
from apps.nodes.models import Event, Node
from racon import ids

__all__ = ["AgentEarningsApi", "AgentLendingApi", "AgentSelfApi"]


def _last_challenge_failure(node: Node) -> dict[str, Any] | None:
    """The node's newest failed challenge (SPEED_CHALLENGE_FAILED, REPLICA_CHALLENGE_FAILED):
    the desktop app notifies when a new one appears."""
    ev = (
        Event.objects.filter(node=node, kind__endswith="CHALLENGE_FAILED")
        .order_by("-created_at", "-id")
        .first()
    )
    if ev is None:
        return None
    return {"id": ev.id, "kind": ev.kind, "message": ev.message, "at": ev.created_at.isoformat()}


def _lends(node: Node) -> dict[str, Any]:
    """What the node lends now: its hardware under the policy's caps."""
    caps = ((node.lending or {}).get("policy") or {}).get("caps") or {}
    hw = node.hardware or {}
    threads = node.cpu_logical_cores
    ram = node.ram_total
    gpus = []
    for g in hw.get("gpus") or []:
        if not isinstance(g, dict):
            continue
        vram = int(g.get("vram_total") or 0)
        if caps.get("vram_bytes"):
            vram = min(vram, int(caps["vram_bytes"]))
        gpus.append({"name": str(g.get("name") or ""), "vram_bytes": vram})
    return {
        "threads": min(threads, int(caps["threads"])) if caps.get("threads") else threads,
        "ram_bytes": min(ram, int(caps["ram_bytes"])) if caps.get("ram_bytes") else ram,
        "gpus": gpus,
    }


class AgentSelfApi(APIView):
    """GET /api/agent/self: this node as the controller sees it (node credential)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: dict, 401: dict}, operation_id="agent_self")
    def get(self, request: Request) -> Response:
        node = node_or_401(request)
        if isinstance(node, Response):
            return node
        now = timezone.now()
        midnight = datetime.combine(now.astimezone(UTC).date(), time(0), tzinfo=UTC)
        today = credit_selectors.node_earnings(
            account_id=ids.account_id(node.account_id),
            days=1,
            node_id=ids.node_id(node.id),
            now=now,
        )
        jobs_today = sum(r["jobs"] for r in today if r["day"] == midnight.date())
        view = lending_view(lending=node.lending, now=now)
        return Response(
            {
                "id": str(node.id),
                "name": node.name,
                "state": node.state,
                "drain_requested": node.drain_requested,
                "paused": bool((node.lending or {}).get("paused")),
                "lends": _lends(node),
                "jobs_today": jobs_today,
                "jobs_running": Job.objects.filter(nodes=node, state="RUNNING").count(),
                "lending_open": view.open,
                "last_challenge_failure": _last_challenge_failure(node),
            }
        )


class AgentEarningsApi(APIView):
    """GET /api/agent/earnings?days=30: this node's rows of GET /api/credits/earnings."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: dict, 400: dict, 401: dict}, operation_id="agent_earnings")
    def get(self, request: Request) -> Response:
        node = node_or_401(request)
        if isinstance(node, Response):
            return node
        raw = request.query_params.get("days")
        try:
            days = 30 if raw is None else int(raw)
        except ValueError:
            return Response(
                {"error": {"message": "days: must be a whole number", "field": "days"}}, status=400
            )
        if not 1 <= days <= 366:
            return Response(
                {"error": {"message": "days: must be between 1 and 366", "field": "days"}},
                status=400,
            )
        rows = credit_selectors.node_earnings(
            account_id=ids.account_id(node.account_id), days=days, node_id=ids.node_id(node.id)
        )
        return Response(
            [
                {
                    "node": r["node"],
                    "node_name": r["node_name"],
                    "day": r["day"].isoformat(),
                    "credits": r["credits"],
                    "jobs": r["jobs"],
                    "receipts": r["receipts"],
                }
                for r in rows
            ]
        )


class LendingIn(serializers.Serializer):
    timezone = serializers.CharField(required=False, allow_blank=True, max_length=64)
    windows = serializers.CharField(required=False, allow_blank=True, max_length=4000)
    handoff = serializers.CharField(required=False, allow_blank=True, max_length=16)
    idle_minutes = serializers.CharField(required=False, allow_blank=True, max_length=32)
    cpu_below = serializers.CharField(required=False, allow_blank=True, max_length=32)
    ram_gb = serializers.CharField(required=False, allow_blank=True, max_length=32)
    vram_gb = serializers.CharField(required=False, allow_blank=True, max_length=32)
    threads = serializers.CharField(required=False, allow_blank=True, max_length=32)


class AgentLendingApi(APIView):
    """GET/PUT /api/agent/lending: this node's lending policy, set as the web UI's form sets it."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    def _body(self, node: Node) -> dict[str, Any]:
        lending = node.lending or {}
        return {
            "policy": lending.get("policy"),
            "source": lending.get("source") or "",
            "paused": lending.get("paused") or None,
            "form": form_values(lending.get("policy")),
        }

    @extend_schema(responses={200: dict, 401: dict}, operation_id="agent_lending_get")
    def get(self, request: Request) -> Response:
        node = node_or_401(request)
        if isinstance(node, Response):
            return node
        return Response(self._body(node))

    @extend_schema(
        request=LendingIn, responses={200: dict, 400: dict, 401: dict, 422: dict},
        operation_id="agent_lending_set",
    )  # fmt: skip
    def put(self, request: Request) -> Response:
        node = node_or_401(request)
        if isinstance(node, Response):
            return node
        if not isinstance(request.data, dict):
            return Response(
                {"error": {"message": "the body must be a JSON object of the form's fields"}},
                status=400,
            )
        unknown = sorted(set(request.data) - set(FIELDS))
        if unknown:
            return Response(
                {
                    "error": {
                        "message": f"unknown field(s) {', '.join(unknown)}: "
                        f"the fields are {', '.join(FIELDS)}",
                        "field": unknown[0],
                    }
                },
                status=400,
            )
        data = LendingIn(data=request.data)
        if not data.is_valid():
            name, errs = next(iter(data.errors.items()))
            return Response({"error": {"message": f"{name}: {errs[0]}", "field": name}}, status=400)
        form = {k: str(data.validated_data.get(k, "")) for k in FIELDS}

        def push(wire: dict[str, Any]) -> None:
            command_send(
                node_id=ids.node_id(node.id), kind="set_lending", payload={"lending": wire}
            )

        try:
            node_lending_owner_set(
                node_id=ids.node_id(node.id),
                policy=lending_document(form),
                now=timezone.now(),
                by=f"desktop app on {node.name}",
                push=push,
            )
        except PolicyError as exc:
            return Response(
                {"error": {"message": str(exc), "field": form_field(exc) or "form"}}, status=422
            )
        node.refresh_from_db()
        return Response(self._body(node))
