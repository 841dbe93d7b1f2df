"""Admin APIs for deployments and jobs, and the agents' reports endpoint (/api/agent/reports)."""

from __future__ import annotations

import uuid
from typing import Any, cast

from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.generics import GenericAPIView
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agent.protocol import job_stream_key
from apps.models_repo.models import Model
from apps.nodes.api import (
    AgentErrorSerializer,
    EventOut,
    ReportAcceptedSerializer,
    ReportSerializer,
    node_credentials,
)
from apps.nodes.enrollment import NodeAuthError, node_authenticate_id
from apps.nodes.errors import ReportRefused
from apps.nodes.models import Event, Node
from apps.nodes.states import Engine
from racon.ids import DeploymentId, JobId, NodeId
from racon.logging import log_context
from racon.pagination import LimitPagination
from racon.redis import get_redis

from . import selectors
from .deployments import (
    deployment_create,
    deployment_plan,
    deployment_stop,
    engine_unavailable,
    placement_request_from,
)
from .filters import DeploymentFilter, JobFilter
from .jobs import DeploymentError, job_cancel
from .models import Deployment, Job
from .reports import ReportRateLimited, report_accept
from .scheduler import PlacementRefused
from .states import JOB_IN_FLIGHT


def _error(message: str, status: int, code: str, **extra: Any) -> Response:
    return Response({"error": {"message": message, "code": code, **extra}}, status=status)


class PlacementIn(serializers.Serializer):
    model = serializers.CharField(max_length=200)
    engine = serializers.ChoiceField(
        choices=Engine.choices,
        required=False,
        help_text="llamacpp (llama-server, split over nodes where needed) or vllm (one node, a "
        "safetensors model directory). Omitted: the scheduler's choice, vllm where the model has "
        "a directory, one node with the engine holds it and the deployment serves several "
        "streams at once (VLLM_AUTO_MIN_PARALLEL), else llamacpp; the preview says which and why",
    )
    n_ctx = serializers.IntegerField(required=False, min_value=128, max_value=1_048_576)
    n_parallel = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=64,
        help_text="slots; omitted: as many as memory allows, up to DEFAULT_N_PARALLEL_MAX",
        error_messages={
            "min_value": "n_parallel must be at least 1",
            "max_value": "n_parallel is at most 64",
        },
    )
    nodes = serializers.ListField(
        child=serializers.CharField(max_length=120),
        required=False,
        max_length=64,
        help_text="pin to these nodes (ids or names)",
    )
    exclude_nodes = serializers.ListField(
        child=serializers.CharField(max_length=120), required=False, max_length=64
    )
    primary = serializers.CharField(
        max_length=120,
        required=False,
        help_text="the node (id or name) that runs the llama-server; the plan's other nodes lend "
        "RPC workers. Omitted: the scheduler's choice",
    )
    spread = serializers.BooleanField(
        required=False, default=False, help_text="use every pinned node even when one would do"
    )
    allow_same_node = serializers.BooleanField(
        required=False,
        default=False,
        help_text="place on nodes that already serve this model (one replica per node otherwise)",
    )
    devices = serializers.ListField(
        child=serializers.RegexField(
            r"^([^:\x00]{1,120}:)?[A-Za-z][A-Za-z_]{0,15}[0-9]{0,3}$",
            error_messages={"invalid": "a device is a llama.cpp name (Vulkan0) or node:Vulkan0"},
        ),
        required=False,
        max_length=64,
        help_text="pin the plan's devices by llama.cpp name (CPU, CUDA0, Vulkan0), optionally "
        "node:device (node id or name): only these take layers",
    )


def _resolve(request_data: dict[str, Any]) -> tuple[Model, dict[str, Any]] | Response:
    model = Model.objects.filter(name=request_data["model"]).first()
    if model is None:
        return _error(f"unknown model {request_data['model']!r}", 404, "not_found")
    out = dict(request_data)
    for key in ("nodes", "exclude_nodes"):
        resolved = []
        for ref in request_data.get(key) or []:
            node = Node.objects.filter(name=ref).first() or (
                Node.objects.filter(pk=ref).first() if _looks_uuid(ref) else None
            )
            if node is None:
                return _error(f"unknown node {ref!r}", 404, "not_found", param=key)
            resolved.append(str(node.id))
        out[key] = resolved
    if request_data.get("primary"):
        ref = request_data["primary"]
        node = Node.objects.filter(name=ref).first() or (
            Node.objects.filter(pk=ref).first() if _looks_uuid(ref) else None
        )
        if node is None:
            return _error(f"unknown node {ref!r}", 404, "not_found", param="primary")
        out["primary"] = str(node.id)
    return model, out


def _engine_refused(model: Model, engine: str) -> Response | None:
    """A 400 naming why the engine cannot serve the model, or None (issue 30)."""
    why = engine_unavailable(model, engine)
    if why is None:
        return None
    return _error(why, 400, "engine_unavailable", param="engine")


def _refused(exc: PlacementRefused) -> Response:
    """400 when the request itself is wrong (n_parallel 0, more slots than fit), 422 otherwise."""
    if exc.bad_input:
        return _error(
            exc.reason,
            400,
            exc.code,
            param="n_parallel" if exc.code == "n_parallel_too_large" else None,
            **exc.to_dict(),
        )
    return _error(exc.reason, 422, "placement_refused", **exc.to_dict())


def _looks_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
        return True
    except ValueError:
        return False


class DeploymentOut(serializers.ModelSerializer):
    """A deployment; with a "load" context (deployment_load_context) also its slots in use, its
    queue, and its model's replicas and queue."""

    model = serializers.CharField(source="model.name")
    primary_name = serializers.CharField(
        source="primary.name", default=None, allow_null=True
    )  # no primary until planned
    node_names = serializers.SerializerMethodField()
    slots_in_use = serializers.SerializerMethodField(
        help_text="slots held by running jobs, of n_parallel"
    )
    queue_depth = serializers.SerializerMethodField(
        help_text="requests waiting for a slot of this deployment"
    )
    replicas = serializers.SerializerMethodField(help_text="active deployments of the model")
    model_queue_depth = serializers.SerializerMethodField(
        help_text="requests waiting over every replica of the model"
    )
    model_queue_wait_seconds = serializers.SerializerMethodField(
        help_text="the model's recent queue wait (EWMA)"
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            "model",
            "engine",
            "state",
            "primary",
            "primary_name",
            "node_names",
            "n_ctx",
            "n_parallel",
            "slots_in_use",
            "queue_depth",
            "replicas",
            "model_queue_depth",
            "model_queue_wait_seconds",
            "plan",
            "request",
            "error",
            "revision",
            "created_at",
            "ready_at",
            "stopped_at",
        ]

    def get_node_names(self, obj: Deployment) -> list[str]:
        return [n.name for n in obj.nodes.all()]

    def _load(
        self, obj: Deployment
    ) -> tuple[dict[str, int], dict[str, int], dict[str, selectors.ModelLoad]]:
        load = self.context.get("load")
        if load is not None and str(obj.id) in load[0]:
            return load
        # No list-wide figures (a detail or an action): read this one deployment's, once.
        # The context is the dict the view passed in; the stubs type it as a read-only Mapping.
        own = cast("dict[str, Any]", self.context).setdefault("_own_load", {})
        if str(obj.id) not in own:
            own[str(obj.id)] = selectors.replica_load(deployments=[obj])
        return own[str(obj.id)]

    def get_slots_in_use(self, obj: Deployment) -> int:
        return self._load(obj)[0].get(str(obj.id), 0)

    def get_queue_depth(self, obj: Deployment) -> int:
        return self._load(obj)[1].get(str(obj.id), 0)

    def _model(self, obj: Deployment) -> selectors.ModelLoad | None:
        return self._load(obj)[2].get(str(obj.model_id))

    def get_replicas(self, obj: Deployment) -> int:
        m = self._model(obj)
        return m.replicas if m else 0

    def get_model_queue_depth(self, obj: Deployment) -> int:
        m = self._model(obj)
        return m.queue_depth if m else 0

    def get_model_queue_wait_seconds(self, obj: Deployment) -> float:
        m = self._model(obj)
        return m.queue_wait_seconds if m else 0.0


class DeploymentPreviewApi(APIView):
    """The plan and its predictions, without loading anything. 422 with the reason when impossible."""

    @extend_schema(request=PlacementIn, responses={200: dict, 400: dict, 422: dict})
    def post(self, request: Request) -> Response:
        data = PlacementIn(data=request.data)
        data.is_valid(raise_exception=True)
        resolved = _resolve(data.validated_data)
        if isinstance(resolved, Response):
            return resolved
        model, v = resolved
        if (refused := _engine_refused(model, v.get("engine", "auto"))) is not None:
            return refused
        if not model.files.exists():
            return _error(f"model {model.name!r} has no registered file", 404, "not_found")
        try:
            plan, mf, _ = deployment_plan(
                model=model, request=placement_request_from({"engine": "auto", **v})
            )
        except PlacementRefused as exc:
            return _refused(exc)
        except DeploymentError as exc:
            return _error(str(exc), 404, "not_found")
        body = plan.to_dict()
        for d in body["devices"]:
            d["node_name"] = selectors.node_name(d["node_id"])
        body["primary_name"] = selectors.node_name(NodeId(plan.primary_node_id))
        body["model"] = model.name
        body["n_layer"] = mf.n_layer
        return Response(body)


class DeploymentListCreateApi(GenericAPIView):
    queryset = (
        Deployment.objects.none()
    )  # names the model for the schema; get_queryset() reads the selector
    filter_backends = [DjangoFilterBackend]
    filterset_class = DeploymentFilter
    pagination_class = None

    def get_queryset(self) -> QuerySet[Deployment]:
        return selectors.deployment_list().prefetch_related("nodes")

    @extend_schema(responses=DeploymentOut(many=True))
    def get(self, request: Request) -> Response:
        deps = list(self.filter_queryset(self.get_queryset())[:500])
        return Response(
            DeploymentOut(
                deps, many=True, context={"load": selectors.replica_load(deployments=deps)}
            ).data
        )

    @extend_schema(request=PlacementIn, responses={202: DeploymentOut, 400: dict, 422: dict})
    def post(self, request: Request) -> Response:
        data = PlacementIn(data=request.data)
        data.is_valid(raise_exception=True)
        resolved = _resolve(data.validated_data)
        if isinstance(resolved, Response):
            return resolved
        model, v = resolved
        if (refused := _engine_refused(model, v.get("engine", "auto"))) is not None:
            return refused
        if not model.files.exists():
            return _error(f"model {model.name!r} has no registered file", 404, "not_found")
        try:
            # Refuse impossible constraints up front; an omitted engine is settled here.
            plan, _, req = deployment_plan(
                model=model, request=placement_request_from({"engine": "auto", **v})
            )
        except PlacementRefused as exc:
            return _refused(exc)
        except DeploymentError as exc:
            return _error(str(exc), 404, "not_found")
        dep = deployment_create(
            model=model,
            request=req,
            now=timezone.now(),
            engine_reason=None if v.get("engine") else plan.explanation[0],
        )
        dep.refresh_from_db()
        return Response(DeploymentOut(dep).data, status=202)


class DeploymentDetailApi(APIView):
    class DeploymentDetailOut(DeploymentOut):
        events = serializers.SerializerMethodField()

        class Meta(DeploymentOut.Meta):
            fields = [*DeploymentOut.Meta.fields, "load_report", "events"]

        def get_events(self, obj: Deployment) -> list[dict[str, Any]]:
            # many=True makes a ListSerializer, whose .data is a list; the stubs say ReturnDict.
            return cast(
                "list[dict[str, Any]]",
                EventOut(Event.objects.filter(deployment=obj)[:100], many=True).data,
            )

    @extend_schema(responses=DeploymentDetailOut)
    def get(self, request: Request, deployment_id: DeploymentId) -> Response:
        return Response(
            self.DeploymentDetailOut(get_object_or_404(Deployment, pk=deployment_id)).data
        )


class DeploymentStopApi(APIView):
    @extend_schema(request=None, responses=DeploymentOut)
    def post(self, request: Request, deployment_id: DeploymentId) -> Response:
        get_object_or_404(Deployment, pk=deployment_id)
        return Response(
            DeploymentOut(deployment_stop(deployment_id=deployment_id, now=timezone.now())).data
        )


class JobOut(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name")
    node_names = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "kind",
            "state",
            "model",
            "deployment",
            "account",
            "stream",
            "max_tokens",
            "prompt_tokens",
            "completion_tokens",
            "finish_reason",
            "error",
            "failed_during_execution",
            "ttft_ms",
            "tokens_per_s",
            "stream_chunks",
            "node_names",
            "queued_at",
            "dispatched_at",
            "first_token_at",
            "finished_at",
            "request_id",
        ]

    def get_node_names(self, obj: Job) -> list[str]:
        return [n.name for n in obj.nodes.all()]

    def to_representation(self, obj: Job) -> dict[str, Any]:
        data = super().to_representation(obj)
        live = (self.context.get("live") or {}).get(str(obj.id))
        if live is not None:
            # A running job's figures come from its token stream: the row is written at the end.
            tokens, started = live
            data["completion_tokens"] = tokens
            elapsed = (timezone.now() - started).total_seconds() if started else 0
            data["tokens_per_s"] = round(tokens / elapsed, 2) if elapsed > 0 and tokens else None
        return data


def live_job_figures(jobs: list[Job]) -> dict[str, tuple[int, Any]]:
    """Tokens streamed so far by each running job (one Redis round trip for the whole page)."""
    active = [j for j in jobs if j.state in JOB_IN_FLIGHT]
    if not active:
        return {}
    primaries: dict[uuid.UUID | None, uuid.UUID | None] = dict(
        Deployment.objects.filter(id__in={j.deployment_id for j in active}).values_list(
            "id", "primary_id"
        )
    )
    with get_redis().pipeline(transaction=False) as pipe:
        for j in active:
            pipe.xlen(job_stream_key(str(j.id), str(primaries.get(j.deployment_id))))
        lengths = pipe.execute()
    return {
        str(j.id): (int(n), j.first_token_at or j.dispatched_at)
        for j, n in zip(active, lengths, strict=True)
    }


class JobListApi(GenericAPIView):
    """GET /api/admin/jobs?state=&model=&node=&since=&until=&limit="""

    queryset = (
        Job.objects.none()
    )  # names the model for the schema; get_queryset() reads the selector
    filter_backends = [DjangoFilterBackend]
    filterset_class = JobFilter
    pagination_class = LimitPagination

    def get_queryset(self) -> QuerySet[Job]:
        return selectors.job_list().prefetch_related("nodes")

    @extend_schema(
        responses={200: JobOut(many=True), 404: AgentErrorSerializer}
    )  # 404: node names no node
    def get(self, request: Request) -> Response:
        jobs = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        assert jobs is not None  # LimitPagination always pages
        return self.get_paginated_response(
            JobOut(jobs, many=True, context={"live": live_job_figures(jobs)}).data
        )


class JobDetailApi(APIView):
    class JobDetailOut(JobOut):
        events = serializers.SerializerMethodField()
        timings = serializers.SerializerMethodField()

        class Meta(JobOut.Meta):
            fields = [
                *JobOut.Meta.fields,
                "placement",
                "device_seconds",
                "params",
                "events",
                "timings",
            ]

        def get_events(self, obj: Job) -> list[dict[str, Any]]:
            # many=True makes a ListSerializer, whose .data is a list; the stubs say ReturnDict.
            return cast(
                "list[dict[str, Any]]",
                EventOut(
                    Event.objects.filter(job=obj).order_by("created_at", "id"), many=True
                ).data,
            )

        def get_timings(self, obj: Job) -> dict[str, Any]:
            def ms(a: Any, b: Any) -> float | None:
                return round((b - a).total_seconds() * 1000, 2) if a and b else None

            return {
                "queue_ms": ms(obj.queued_at, obj.dispatched_at),
                "to_first_token_ms": ms(obj.queued_at, obj.first_token_at),
                "total_ms": ms(obj.queued_at, obj.finished_at),
                "runtime_ttft_ms": obj.ttft_ms,
                "tokens_per_s": obj.tokens_per_s,
            }

    @extend_schema(responses=JobDetailOut)
    def get(self, request: Request, job_id: JobId) -> Response:
        job = get_object_or_404(Job, pk=job_id)
        return Response(self.JobDetailOut(job, context={"live": live_job_figures([job])}).data)


class JobCancelApi(APIView):
    @extend_schema(request=None, responses=JobOut)
    def post(self, request: Request, job_id: JobId) -> Response:
        get_object_or_404(Job, pk=job_id)
        job_cancel(job_id=job_id, now=timezone.now(), reason="cancelled by an operator")
        return Response(JobOut(Job.objects.get(pk=job_id)).data)


# --- the agent's reports (/api/agent/reports): node-authenticated, about jobs and deployments ---


class AgentReportsApi(APIView):
    """Reports from agents: command results, events, finished jobs, model files, link probes."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        request=ReportSerializer,
        responses={
            202: ReportAcceptedSerializer,
            400: AgentErrorSerializer,
            401: AgentErrorSerializer,
            409: AgentErrorSerializer,
            413: AgentErrorSerializer,
            429: AgentErrorSerializer,
        },
        description=(
            "409: the report is not from the node the controller's record names (not a member of"
            " the job's or deployment's plan, or not the node the command was sent to). 429: more"
            " than NODE_REPORT_RATE_PER_MINUTE reports from this node within a minute"
            " (Retry-After)."
        ),
    )
    def post(self, request: Request) -> Response:
        creds = node_credentials(request)
        if creds is None:
            return Response({"error": {"message": "missing node credential"}}, status=401)
        try:
            node_id = node_authenticate_id(node_id=creds[0], credential=creds[1])
        except (NodeAuthError, ValueError) as exc:
            return Response(
                {
                    "error": {
                        "message": str(exc),
                        "code": getattr(exc, "code", "invalid_credential"),
                    }
                },
                status=401,
            )
        data = ReportSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        payload = data.validated_data["payload"]
        with log_context(
            node_id=node_id,
            job_id=payload.get("job_id"),
            deployment_id=payload.get("deployment_id"),
        ):
            try:
                result = report_accept(
                    node_id=node_id, report=data.validated_data, now=timezone.now()
                )
            except ReportRefused as exc:
                # 409, not 403: the agent takes 401/403 as "my credential is gone" and stops, and an
                # honest node can send a late report (it was dropped from a revised plan).
                return Response({"error": {"message": str(exc), "code": exc.code}}, status=409)
            except ReportRateLimited as exc:
                # 429: the agent's outbox retries it with backoff, in order.
                return Response(
                    {"error": {"message": str(exc), "code": "rate_limited"}},
                    status=429,
                    headers={"Retry-After": str(exc.retry_after)},
                )
            except ValueError as exc:
                return Response(
                    {"error": {"message": str(exc), "code": "invalid_report"}}, status=400
                )
        return Response({"accepted": True, **(result or {})}, status=202)
