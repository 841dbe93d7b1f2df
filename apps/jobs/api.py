"""Admin APIs for deployments and jobs."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.models_repo.models import Model
from apps.nodes.api import EventOut
from apps.nodes.models import Event, Node

from . import selectors, services
from .models import Deployment, Job
from .scheduler import PlacementRefused
from .states import DeploymentState, JobState


def _error(message: str, status: int, code: str, **extra: Any) -> Response:
    return Response({"error": {"message": message, "code": code, **extra}}, status=status)


class PlacementIn(serializers.Serializer):
    model = serializers.CharField(max_length=200)
    n_ctx = serializers.IntegerField(required=False, min_value=128, max_value=1_048_576)
    n_parallel = serializers.IntegerField(
        required=False, min_value=1, max_value=64, help_text="slots; omitted: as many as memory allows, up to DEFAULT_N_PARALLEL_MAX",
        error_messages={"min_value": "n_parallel must be at least 1", "max_value": "n_parallel is at most 64"},
    )
    nodes = serializers.ListField(child=serializers.CharField(max_length=120), required=False, max_length=64, help_text="pin to these nodes (ids or names)")
    exclude_nodes = serializers.ListField(child=serializers.CharField(max_length=120), required=False, max_length=64)
    spread = serializers.BooleanField(required=False, default=False, help_text="use every pinned node even when one would do")
    allow_same_node = serializers.BooleanField(required=False, default=False, help_text="place on nodes that already serve this model (one replica per node otherwise)")


def _resolve(request_data: dict[str, Any]) -> tuple[Model, dict[str, Any]] | Response:
    model = Model.objects.filter(name=request_data["model"]).first()
    if model is None:
        return _error(f"unknown model {request_data['model']!r}", 404, "not_found")
    out = dict(request_data)
    for key in ("nodes", "exclude_nodes"):
        resolved = []
        for ref in request_data.get(key) or []:
            node = Node.objects.filter(name=ref).first() or (Node.objects.filter(pk=ref).first() if _looks_uuid(ref) else None)
            if node is None:
                return _error(f"unknown node {ref!r}", 404, "not_found", param=key)
            resolved.append(str(node.id))
        out[key] = resolved
    return model, out


def _refused(exc: PlacementRefused) -> Response:
    """400 when the request itself is wrong (n_parallel 0, more slots than fit), 422 otherwise."""
    if exc.bad_input:
        return _error(exc.reason, 400, exc.code, param="n_parallel" if exc.code == "n_parallel_too_large" else None, **exc.to_dict())
    return _error(exc.reason, 422, "placement_refused", **exc.to_dict())


def _looks_uuid(value: str) -> bool:
    import uuid

    try:
        uuid.UUID(value)
        return True
    except ValueError:
        return False


class DeploymentOut(serializers.ModelSerializer):
    """A deployment; with a "load" context (deployment_load_context) also its slots in use, its
    queue, and its model's replicas and queue."""

    model = serializers.CharField(source="model.name")
    primary_name = serializers.CharField(source="primary.name", default=None, allow_null=True)  # no primary until planned
    node_names = serializers.SerializerMethodField()
    slots_in_use = serializers.SerializerMethodField(help_text="slots held by running jobs, of n_parallel")
    queue_depth = serializers.SerializerMethodField(help_text="requests waiting for a slot of this deployment")
    replicas = serializers.SerializerMethodField(help_text="active deployments of the model")
    model_queue_depth = serializers.SerializerMethodField(help_text="requests waiting over every replica of the model")
    model_queue_wait_seconds = serializers.SerializerMethodField(help_text="the model's recent queue wait (EWMA)")

    class Meta:
        model = Deployment
        fields = [
            "id", "model", "state", "primary", "primary_name", "node_names", "n_ctx", "n_parallel", "slots_in_use", "queue_depth",
            "replicas", "model_queue_depth", "model_queue_wait_seconds", "plan", "request", "error", "revision", "created_at",
            "ready_at", "stopped_at",
        ]

    def get_node_names(self, obj: Deployment) -> list[str]:
        return [n.name for n in obj.nodes.all()]

    def _load(self, obj: Deployment) -> tuple[dict[str, int], dict[str, int], dict[str, selectors.ModelLoad]]:
        load = self.context.get("load")
        if load is not None and str(obj.id) in load[0]:
            return load
        # No list-wide figures (a detail or an action): read this one deployment's, once.
        own = self.context.setdefault("_own_load", {})
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
        mf = model.files.order_by("-created_at").first()
        if mf is None:
            return _error(f"model {model.name!r} has no registered file", 404, "not_found")
        try:
            plan = services.deployment_preview(model_file=mf, request=services.placement_request_from(v))
        except PlacementRefused as exc:
            return _refused(exc)
        body = plan.to_dict()
        for d in body["devices"]:
            d["node_name"] = selectors.node_name(d["node_id"])
        body["primary_name"] = selectors.node_name(plan.primary_node_id)
        body["model"] = model.name
        body["n_layer"] = mf.n_layer
        return Response(body)


class DeploymentListCreateApi(APIView):
    @extend_schema(responses=DeploymentOut(many=True))
    def get(self, request: Request) -> Response:
        state = request.query_params.get("state")
        if state and state not in DeploymentState.values:
            return _error(f"unknown state {state!r}", 400, "invalid")
        deps = list(selectors.deployment_list(state=state, model=request.query_params.get("model")).prefetch_related("nodes")[:500])
        return Response(DeploymentOut(deps, many=True, context={"load": selectors.replica_load(deployments=deps)}).data)

    @extend_schema(request=PlacementIn, responses={202: DeploymentOut, 400: dict, 422: dict})
    def post(self, request: Request) -> Response:
        data = PlacementIn(data=request.data)
        data.is_valid(raise_exception=True)
        resolved = _resolve(data.validated_data)
        if isinstance(resolved, Response):
            return resolved
        model, v = resolved
        req = services.placement_request_from(v)
        mf = model.files.order_by("-created_at").first()
        if mf is None:
            return _error(f"model {model.name!r} has no registered file", 404, "not_found")
        try:
            services.deployment_preview(model_file=mf, request=req)  # refuse impossible constraints up front
        except PlacementRefused as exc:
            return _refused(exc)
        dep = services.deployment_create(model=model, request=req, now=timezone.now())
        dep.refresh_from_db()
        return Response(DeploymentOut(dep).data, status=202)


class DeploymentDetailApi(APIView):
    class DeploymentDetailOut(DeploymentOut):
        events = serializers.SerializerMethodField()

        class Meta(DeploymentOut.Meta):
            fields = [*DeploymentOut.Meta.fields, "load_report", "events"]

        def get_events(self, obj: Deployment) -> list[dict[str, Any]]:
            return EventOut(Event.objects.filter(deployment=obj)[:100], many=True).data

    @extend_schema(responses=DeploymentDetailOut)
    def get(self, request: Request, deployment_id: str) -> Response:
        return Response(self.DeploymentDetailOut(get_object_or_404(Deployment, pk=deployment_id)).data)


class DeploymentStopApi(APIView):
    @extend_schema(request=None, responses=DeploymentOut)
    def post(self, request: Request, deployment_id: str) -> Response:
        get_object_or_404(Deployment, pk=deployment_id)
        return Response(DeploymentOut(services.deployment_stop(deployment_id=deployment_id, now=timezone.now())).data)


class JobOut(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name")
    node_names = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id", "kind", "state", "model", "deployment", "account", "stream", "max_tokens", "prompt_tokens", "completion_tokens",
            "finish_reason", "error", "failed_during_execution", "ttft_ms", "tokens_per_s", "stream_chunks", "node_names",
            "queued_at", "dispatched_at", "first_token_at", "finished_at", "request_id",
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
    from agent.protocol import job_stream_key  # noqa: PLC0415
    from racon.redis import get_redis  # noqa: PLC0415

    active = [j for j in jobs if j.state in (JobState.DISPATCHED, JobState.RUNNING)]
    if not active:
        return {}
    primaries = dict(Deployment.objects.filter(id__in={j.deployment_id for j in active}).values_list("id", "primary_id"))
    with get_redis().pipeline(transaction=False) as pipe:
        for j in active:
            pipe.xlen(job_stream_key(str(j.id), str(primaries.get(j.deployment_id))))
        lengths = pipe.execute()
    return {str(j.id): (int(n), j.first_token_at or j.dispatched_at) for j, n in zip(active, lengths, strict=True)}


class JobListApi(APIView):
    """GET /api/admin/jobs?state=&model=&node=&since=&until="""

    @extend_schema(responses=JobOut(many=True))
    def get(self, request: Request) -> Response:
        q = request.query_params
        state = q.get("state")
        if state and state not in JobState.values:
            return _error(f"unknown state {state!r}", 400, "invalid", fields={"state": [f"one of {JobState.values}"]})
        since = parse_datetime(q["since"]) if q.get("since") else None
        until = parse_datetime(q["until"]) if q.get("until") else None
        if (q.get("since") and since is None) or (q.get("until") and until is None):
            return _error("since/until must be ISO 8601 datetimes", 400, "invalid")
        node = q.get("node")
        if node and not _looks_uuid(node):
            found = Node.objects.filter(name=node).values_list("id", flat=True).first()
            if found is None:
                return _error(f"unknown node {node!r}", 404, "not_found")
            node = str(found)
        try:
            limit = min(int(q.get("limit", 100)), 1000)
        except ValueError:
            return _error("limit must be an integer", 400, "invalid")
        jobs = list(selectors.job_list(state=state, model=q.get("model"), node_id=node, since=since, until=until).prefetch_related("nodes")[:limit])
        return Response(JobOut(jobs, many=True, context={"live": live_job_figures(jobs)}).data)


class JobDetailApi(APIView):
    class JobDetailOut(JobOut):
        events = serializers.SerializerMethodField()
        timings = serializers.SerializerMethodField()

        class Meta(JobOut.Meta):
            fields = [*JobOut.Meta.fields, "placement", "device_seconds", "params", "events", "timings"]

        def get_events(self, obj: Job) -> list[dict[str, Any]]:
            return EventOut(Event.objects.filter(job=obj).order_by("created_at", "id"), many=True).data

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
    def get(self, request: Request, job_id: str) -> Response:
        job = get_object_or_404(Job, pk=job_id)
        return Response(self.JobDetailOut(job, context={"live": live_job_figures([job])}).data)


class JobCancelApi(APIView):
    @extend_schema(request=None, responses=JobOut)
    def post(self, request: Request, job_id: str) -> Response:
        get_object_or_404(Job, pk=job_id)
        services.job_cancel(job_id=job_id, now=timezone.now(), reason="cancelled by an operator")
        return Response(JobOut(Job.objects.get(pk=job_id)).data)
