"""Node APIs: the agent endpoints (/api/agent/*) and the admin endpoints (/api/admin/nodes, tokens, events)."""

from __future__ import annotations

import json
import math
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from agent.protocol import PROTOCOL_VERSION, REPORT_KINDS, SUPPORTED_PROTOCOL_VERSIONS
from apps.accounts.models import Account
from apps.accounts.principal import request_account_id
from racon import ids
from racon.ids import NodeId
from racon.net import client_address
from racon.pagination import LimitPagination
from racon.redis_acl import AclUnavailable, node_redis_url

from . import join, selectors
from .commands import node_command_key
from .enrollment import (
    EnrollmentConflict,
    EnrollmentError,
    NodeAuthError,
    credential_hash,
    enrollment_token_issue,
    enrollment_token_revoke,
    hardware_bounds_errors,
    node_authenticate,
    node_enroll,
    node_reenroll_allow,
    node_revoke,
)
from .filters import EventFilter, NodeFilter
from .heartbeats import NodeMirrorLost, NodeRateLimited, node_heartbeat, telemetry_clean
from .lending import PolicyError, node_lending_claim
from .links import link_matrix
from .models import EnrollmentToken, Event, Node
from .services import node_drain, node_undrain
from .states import Engine, NodeState

# --- wire serializers (checked against agent/protocol.py by a contract test) ---------------------


class GpuSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0)
    vendor = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=200)
    uuid = serializers.CharField(max_length=100, allow_blank=True)
    vram_total = serializers.IntegerField(min_value=0)
    vram_free = serializers.IntegerField(min_value=0)
    driver = serializers.CharField(max_length=64, allow_blank=True)
    # The agent's GPU benchmark (bounded by hardware_bounds_errors); absent: assumed figures.
    gflops = serializers.FloatField(min_value=0, required=False)
    mem_bandwidth_gbps = serializers.FloatField(min_value=0, required=False)
    # llama.cpp's device name and backend (agent/hardware/devices.py): what plans pin and name.
    device = serializers.RegexField(r"^[A-Za-z][A-Za-z_]{0,15}[0-9]{0,3}$", required=False)
    backend = serializers.CharField(max_length=32, required=False)
    software = serializers.BooleanField(required=False)
    nvml_index = serializers.IntegerField(min_value=0, required=False)
    pci_bus_id = serializers.CharField(max_length=32, required=False)


class HardwareSerializer(serializers.Serializer):
    cpu = serializers.DictField()
    memory = serializers.DictField(child=serializers.IntegerField(min_value=0))
    swap = serializers.DictField(child=serializers.IntegerField(min_value=0))
    disk = serializers.DictField()
    network = serializers.ListField(child=serializers.DictField(), max_length=64)
    gpus = GpuSerializer(many=True, max_length=16)  # type: ignore[call-arg]  # many=True passes max_length to the ListSerializer; the stubs miss it
    benchmark = serializers.DictField(child=serializers.FloatField(min_value=0), required=False)
    fingerprint = serializers.CharField(max_length=128, required=False)
    # The engines the node runs (issue 30): a claim, used only to say where vLLM could go.
    engines = serializers.ListField(
        child=serializers.ChoiceField(choices=Engine.choices), required=False, max_length=2
    )

    def validate_cpu(self, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "physical_cores", "logical_cores"):
            if key not in value:
                raise serializers.ValidationError(f"missing cpu.{key}")
        for key in ("physical_cores", "logical_cores"):
            if not isinstance(value[key], int) or value[key] < 0:
                raise serializers.ValidationError(f"cpu.{key} must be a non-negative integer")
        return value

    def validate_memory(self, value: dict[str, int]) -> dict[str, int]:
        if "total" not in value:
            raise serializers.ValidationError("missing memory.total")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # A node's figures are claims; past these bounds they are not plausible (compute-plane trust).
        errors = hardware_bounds_errors(attrs)
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class ModelFileInfoSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=500)
    file_name = serializers.CharField(max_length=255)
    size = serializers.IntegerField(min_value=0)
    mtime = serializers.FloatField()
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")


class EnrollRequestSerializer(serializers.Serializer):
    token = serializers.CharField(max_length=200)
    node_name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", max_length=63)
    machine_id = serializers.CharField(max_length=128)
    agent_version = serializers.CharField(max_length=32)
    advertise_address = serializers.IPAddressField()
    rpc_port = serializers.IntegerField(min_value=1, max_value=65535)
    hardware = HardwareSerializer()
    models = ModelFileInfoSerializer(many=True, required=False, max_length=1000)  # type: ignore[call-arg]  # many=True passes max_length to the ListSerializer; the stubs miss it
    protocol_version = serializers.IntegerField(min_value=0, required=False, default=1)
    lending = serializers.DictField(required=False, help_text="agent/lending.py wire form")


class AgentErrorSerializer(serializers.Serializer):
    """{"error": {"message", "code", "fields"?}}: the admin and agent APIs' one error format."""

    class Body(serializers.Serializer):
        message = serializers.CharField()
        code = serializers.CharField(required=False)
        fields = serializers.DictField(required=False)  # type: ignore[assignment]  # a declared field; the metaclass moves it off the class

    error = Body()


class EnrollResponseSerializer(serializers.Serializer):
    node_id = serializers.CharField()
    credential = serializers.CharField()
    redis_url = serializers.CharField()
    command_key = serializers.CharField(
        required=False, help_text="hex: the key this node's commands are signed with"
    )
    heartbeat_interval = serializers.FloatField()
    state = serializers.CharField()
    protocol_version = serializers.IntegerField(required=False)


class HeartbeatSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=NodeState.choices, required=False)
    sent_at = serializers.FloatField(required=False)
    protocol_version = serializers.IntegerField(min_value=0, required=False)
    want_command_key = serializers.BooleanField(required=False)
    telemetry = serializers.DictField()


class HeartbeatResponseSerializer(serializers.Serializer):
    state = serializers.CharField()
    heartbeat_interval = serializers.FloatField()
    protocol_version = serializers.IntegerField(required=False)
    command_key = serializers.CharField(required=False)


class ProtocolInfoSerializer(serializers.Serializer):
    protocol_version = serializers.IntegerField()
    supported_protocol_versions = serializers.ListField(child=serializers.IntegerField())


def agent_protocol_refusal(*, agent_version: str, agent_protocol: int) -> str | None:
    """The controller's refusal of an agent speaking `agent_protocol`, or None if it speaks it."""
    if agent_protocol in SUPPORTED_PROTOCOL_VERSIONS:
        return None
    supported = ", ".join(str(p) for p in SUPPORTED_PROTOCOL_VERSIONS)
    return (
        f"this controller speaks node protocol {PROTOCOL_VERSION} (supports {supported}); "
        f"agent {agent_version} speaks protocol {agent_protocol}: install the controller's agent "
        "with `node-agent upgrade` or by running the join line again"
    )


class ReportSerializer(serializers.Serializer):
    id = serializers.CharField(max_length=64)
    kind = serializers.ChoiceField(choices=[(k, k) for k in REPORT_KINDS])
    command_id = serializers.CharField(max_length=64, required=False, allow_null=True)
    payload = serializers.DictField()


def parse_node_auth(header: str) -> tuple[str, str] | None:
    """(node_id, credential) from 'Node <id>:<credential>', or None when malformed."""
    scheme, _, rest = header.partition(" ")
    if scheme != "Node" or ":" not in rest:
        return None
    node_id, _, credential = rest.strip().partition(":")
    return node_id, credential


def node_credentials(request: Any) -> tuple[str, str] | None:
    return parse_node_auth(
        request.headers.get("Authorization", "") if hasattr(request, "headers") else ""
    )


# --- agent endpoints --------------------------------------------------------------------------


def node_or_401(request: Request) -> Node | Response:
    """The node whose credential the request carries (Authorization: Node <id>:<credential>), or
    the 401 naming why (coded: missing_credential, invalid_credential, node_revoked, ...)."""
    creds = node_credentials(request)
    if creds is None:
        return Response(
            {
                "error": {
                    "message": "missing or malformed 'Authorization: Node <id>:<credential>'",
                    "code": "missing_credential",
                }
            },
            status=status.HTTP_401_UNAUTHORIZED,
        )
    try:
        return node_authenticate(node_id=creds[0], credential=creds[1])
    except (NodeAuthError, ValueError) as exc:
        code = getattr(exc, "code", "invalid_credential")
        return Response(
            {"error": {"message": str(exc), "code": code}}, status=status.HTTP_401_UNAUTHORIZED
        )


def redis_url_or_503(node: Node) -> str | Response:
    """The node's Redis URL (its own ACL user, granted now), or 503 when Redis refuses ACLs."""
    try:
        return node_redis_url(node_id=ids.node_id(node.id))
    except AclUnavailable as exc:
        return Response(
            {"error": {"message": str(exc), "code": "redis_acl_unavailable"}},
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
        )


class AgentEnrollApi(APIView):
    """Exchange an administrator-issued enrollment token for a node id and credential."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    parser_classes = [JSONParser]  # nested objects (hardware, models): JSON only

    @extend_schema(
        request=EnrollRequestSerializer,
        responses={
            201: EnrollResponseSerializer,
            200: EnrollResponseSerializer,
            400: AgentErrorSerializer,
            401: AgentErrorSerializer,
            403: AgentErrorSerializer,
            409: AgentErrorSerializer,
            413: AgentErrorSerializer,
            503: AgentErrorSerializer,
        },
        description=(
            "Re-enrolling a machine already enrolled needs that node's current credential in "
            "`Authorization: Node <id>:<credential>` (or an operator's allow-reenroll): else 409."
        ),
    )
    def post(self, request: Request) -> Response:
        data = EnrollRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        # Refused before the token is looked at: a refused version never uses the token up.
        refusal = agent_protocol_refusal(
            agent_version=v["agent_version"], agent_protocol=v["protocol_version"]
        )
        if refusal:
            return Response(
                {"error": {"message": refusal, "code": "protocol_unsupported"}},
                status=status.HTTP_409_CONFLICT,
            )
        # A plain-http controller on a network hands no Redis URL (nor node password, nor
        # command key) over an unauthenticated channel, unless RACON_INSECURE_LAN=1 says so.
        # Refused before the token is looked at, so the token is not used up.
        if (insecure := join.insecure_problem()) is not None:
            return Response(
                {"error": {"message": insecure, "code": "insecure_lan"}},
                status=status.HTTP_403_FORBIDDEN,
            )
        try:
            enrollment = node_enroll(
                token=v["token"],
                node_name=v["node_name"],
                machine_id=v["machine_id"],
                hardware=v["hardware"],
                address=v["advertise_address"],
                rpc_port=v["rpc_port"],
                agent_version=v["agent_version"],
                models=v.get("models"),
                now=timezone.now(),
                presented=node_credentials(request),
                source_address=client_address(request),
            )
        except EnrollmentConflict as exc:
            return Response(
                {"error": {"message": str(exc), "code": exc.code}}, status=status.HTTP_409_CONFLICT
            )
        except EnrollmentError as exc:
            return Response(
                {"error": {"message": str(exc), "code": "enrollment_refused"}},
                status=status.HTTP_401_UNAUTHORIZED,
            )
        node = enrollment.node
        if v.get("lending"):
            try:
                node_lending_claim(
                    node_id=ids.node_id(node.id), policy=v["lending"], now=timezone.now()
                )
            except PolicyError as exc:
                return Response(
                    {"error": {"message": f"lending policy: {exc}", "code": "invalid_policy"}},
                    status=status.HTTP_400_BAD_REQUEST,
                )
        redis_url = redis_url_or_503(node)
        if isinstance(redis_url, Response):
            return redis_url
        body = {
            "node_id": str(node.id),
            "credential": enrollment.credential,
            "redis_url": redis_url,
            "heartbeat_interval": settings.HEARTBEAT_INTERVAL,
            "state": node.state,
            "protocol_version": PROTOCOL_VERSION,
            "command_key": enrollment.command_key,
        }
        return Response(
            body, status=status.HTTP_201_CREATED if enrollment.created else status.HTTP_200_OK
        )


class AgentRedisApi(APIView):
    """POST /api/agent/redis: the node's Redis URL as it is now (node credential).

    An agent asks when its Redis stays unreachable or refuses its user: the controller's embedded
    Redis starts empty on another port at each `make run`, and its ACL users live only in memory,
    so the URL handed out at enrollment goes stale when the controller restarts. With NODE_REDIS_ACL
    the node's user is granted again with a new password (racon/redis_acl.py), so only the caller
    holds it; a revoked node gets 401 like everywhere else."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        request=None, responses={200: dict, 401: dict, 503: dict}, operation_id="agent_redis"
    )
    def post(self, request: Request) -> Response:
        node = node_or_401(request)
        if isinstance(node, Response):
            return node
        redis_url = redis_url_or_503(node)
        if isinstance(redis_url, Response):
            return redis_url
        return Response({"redis_url": redis_url})


class AgentProtocolApi(APIView):
    """The node protocol this controller speaks and the agent protocols it accepts.

    No authentication and no token: an agent reads it before enrolling, so a version either side
    refuses never uses up the enrollment token.
    """

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: ProtocolInfoSerializer})
    def get(self, request: Request) -> Response:
        return Response(
            {
                "protocol_version": PROTOCOL_VERSION,
                "supported_protocol_versions": list(SUPPORTED_PROTOCOL_VERSIONS),
            }
        )


async def heartbeat_handle(
    *, method: str, authorization: str, body: bytes
) -> tuple[int, dict[str, Any]]:
    """The heartbeat endpoint's logic, shared by the Django view and the ASGI fast path."""
    if method != "POST":
        return 405, {"error": {"message": "method not allowed"}}
    creds = parse_node_auth(authorization)
    if creds is None:
        return 401, {
            "error": {"message": "missing or malformed 'Authorization: Node <id>:<credential>'"}
        }
    try:
        node_id = ids.node_id(creds[0])  # converted once: every use below is typed
    except ValueError:
        return 401, {
            "error": {
                "message": "malformed node id in 'Authorization: Node <id>:<credential>': expected a UUID",
                "code": "invalid_credential",
            }
        }
    credential = creds[1]
    if len(body) > settings.MAX_AGENT_BODY_BYTES:
        return 413, {
            "error": {
                "message": f"heartbeat body over {settings.MAX_AGENT_BODY_BYTES} bytes",
                "code": "request_too_large",
            }
        }
    try:
        payload = json.loads(body or b"{}")
    except ValueError as exc:
        return 400, {"error": {"message": f"malformed JSON: {exc}"}}
    if not isinstance(payload, dict) or not isinstance(payload.get("telemetry", {}), dict):
        return 400, {
            "error": {
                "message": "heartbeat must be an object with a 'telemetry' object",
                "fields": {"telemetry": ["must be an object"]},
            }
        }
    theirs = payload.get("protocol_version", 1)
    if isinstance(theirs, bool) or not isinstance(theirs, int) or theirs < 0:
        return 400, {
            "error": {
                "message": f"protocol_version {theirs!r} is not a protocol version",
                "code": "invalid",
                "fields": {"protocol_version": ["must be a non-negative integer"]},
            }
        }
    telemetry = payload.get("telemetry") or {}
    refusal = agent_protocol_refusal(
        agent_version=str(telemetry.get("agent_version") or "(version not sent)"),
        agent_protocol=theirs,
    )
    if refusal:  # before anything is read or written: the refused beat changes nothing
        return 409, {"error": {"message": refusal, "code": "protocol_unsupported"}}
    wanted = payload.get("state")
    if wanted is not None and wanted not in NodeState.values:
        return 400, {
            "error": {
                "message": f"unknown state {wanted!r}",
                "fields": {"state": [f"not one of {NodeState.values}"]},
            }
        }
    try:
        payload = {**payload, "telemetry": telemetry_clean(payload.get("telemetry") or {})}
    except ValueError as exc:
        return 400, {
            "error": {
                "message": f"malformed telemetry: {exc}",
                "code": "invalid",
                "fields": {"telemetry": [str(exc)]},
            }
        }
    try:
        state = await node_heartbeat(
            node_id=node_id, credential=credential, payload=payload, now=timezone.now()
        )
    except NodeAuthError as exc:
        return 401, {"error": {"message": str(exc), "code": exc.code}}
    except NodeRateLimited as exc:
        return 429, {
            "error": {"message": str(exc), "code": "rate_limited", "retry_after": exc.retry_after}
        }
    except NodeMirrorLost as exc:
        return 503, {"error": {"message": str(exc), "code": "mirror_lost", "retry_after": 1}}
    beat: dict[str, Any] = {
        "state": state,
        "heartbeat_interval": settings.HEARTBEAT_INTERVAL,
        "protocol_version": PROTOCOL_VERSION,
    }
    if payload.get("want_command_key") is True:
        # An agent enrolled before commands were signed; the credential was just checked.
        key = node_command_key(node_id=node_id, credential_hash=credential_hash(credential))
        beat["command_key"] = key.hex()
    return 200, beat


def heartbeat_headers(status: int, payload: dict[str, Any]) -> dict[str, str]:
    """The headers beside a heartbeat answer: a 429 or 503 says when to come back (Retry-After,
    whole seconds, as the body's retry_after), so a client that reads only headers backs off too."""
    if status not in (429, 503):
        return {}
    try:
        seconds = float(payload["error"]["retry_after"])
    except (KeyError, TypeError, ValueError):
        seconds = 1.0
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


@csrf_exempt
async def agent_heartbeat(request: HttpRequest) -> JsonResponse:
    """Authenticated by the node credential; costs no database write unless the state changes.

    Under daphne, racon.asgi answers this path before Django's request machinery (same logic).
    """
    status_code, body = await heartbeat_handle(
        method=request.method or "",
        authorization=request.headers.get("Authorization", ""),
        body=request.body,
    )
    return JsonResponse(body, status=status_code, headers=heartbeat_headers(status_code, body))


class ReportAcceptedSerializer(serializers.Serializer):
    accepted = serializers.BooleanField()
    duplicate = serializers.BooleanField(required=False)
    matched = serializers.IntegerField(required=False)


# --- admin endpoints --------------------------------------------------------------------------


class NodeOut(serializers.ModelSerializer):
    heartbeat_age = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "state",
            "state_changed_at",
            "account",
            "address",
            "rpc_port",
            "agent_version",
            "cpu_model",
            "cpu_physical_cores",
            "cpu_logical_cores",
            "ram_total",
            "ram_available",
            "vram_total",
            "vram_free",
            "gpu_count",
            "disk_free",
            "gflops",
            "mem_bandwidth_gbps",
            "drain_requested",
            "enrolled_at",
            "revoked_at",
            "heartbeat_age",
        ]

    def get_heartbeat_age(self, obj: Node) -> float | None:
        ages = self.context.get("ages") or {}
        return ages.get(str(obj.id))


class EventOut(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = [
            "id",
            "kind",
            "category",
            "node",
            "job",
            "deployment",
            "old_state",
            "new_state",
            "message",
            "data",
            "created_at",
        ]


class NodeListApi(GenericAPIView):
    """GET /api/admin/nodes?state=READY&name=box"""

    queryset = Node.objects.all()
    filter_backends = [DjangoFilterBackend]
    filterset_class = NodeFilter
    pagination_class = None

    @extend_schema(responses=NodeOut(many=True))
    def get(self, request: Request) -> Response:
        nodes = list(self.filter_queryset(self.get_queryset())[: selectors.NODE_LIST_MAX])
        ages = selectors.heartbeat_ages([str(n.id) for n in nodes], now=timezone.now())
        return Response(NodeOut(nodes, many=True, context={"ages": ages}).data)


class NodeDetailApi(APIView):
    class NodeDetailOut(NodeOut):
        hardware = serializers.JSONField()
        events = serializers.SerializerMethodField()
        telemetry = serializers.SerializerMethodField()
        deployments = serializers.SerializerMethodField()

        class Meta(NodeOut.Meta):
            fields = [*NodeOut.Meta.fields, "hardware", "events", "telemetry", "deployments"]

        def get_events(self, obj: Node) -> list[dict[str, Any]]:
            # many=True makes a ListSerializer, whose .data is a list; the stubs say ReturnDict.
            return cast(
                "list[dict[str, Any]]",
                EventOut(
                    selectors.node_events(node_id=ids.node_id(obj.id), limit=50), many=True
                ).data,
            )

        def get_telemetry(self, obj: Node) -> dict[str, Any]:
            return selectors.node_telemetry(node_id=ids.node_id(obj.id))

        def get_deployments(self, obj: Node) -> list[dict[str, Any]]:
            return [
                {"id": str(d.id), "model": d.model.name, "state": d.state}
                for d in obj.deployments.select_related("model")
            ]

    @extend_schema(responses=NodeDetailOut)
    def get(self, request: Request, node_id: NodeId) -> Response:
        node = get_object_or_404(Node, pk=node_id)
        ages = selectors.heartbeat_ages([str(node.id)], now=timezone.now())
        return Response(self.NodeDetailOut(node, context={"ages": ages}).data)


class NodeLinkOut(serializers.Serializer):
    source = serializers.CharField(help_text="node that measured")  # type: ignore[assignment]  # a declared field; the metaclass moves it off the class
    source_name = serializers.CharField()
    target = serializers.CharField(help_text="peer it measured")
    target_name = serializers.CharField()
    rtt_ms = serializers.FloatField(help_text="application-level ping through the RPC tunnel")
    bandwidth_mbps = serializers.FloatField(help_text="Mbit/s of a timed bulk transfer")
    rtt_method = serializers.CharField(help_text="tunnel-echo, or tcp-connect (older peer)")
    bandwidth_method = serializers.CharField(
        help_text="measured, or nic:<if> / loopback / assumed (nominal, an upper bound)"
    )
    measured_at = serializers.DateTimeField()
    age_seconds = serializers.FloatField()
    expired = serializers.BooleanField()


class NodeLinksOut(serializers.Serializer):
    max_age_seconds = serializers.FloatField()
    probe_interval_seconds = serializers.FloatField()
    links = NodeLinkOut(many=True)


class NodeLinksApi(APIView):
    """GET /api/admin/nodes/links: the measured link matrix (from → to), with each link's age.

    Expired links (older than LINK_MAX_AGE_SECONDS) are listed with ``expired`` true until the
    periodic re-probe prunes them; the scheduler treats them as unknown (its default link)."""

    Out = NodeLinksOut

    @extend_schema(responses=NodeLinksOut)
    def get(self, request: Request) -> Response:
        now = timezone.now()
        rows = link_matrix(now=now)
        out = {
            "max_age_seconds": float(settings.LINK_MAX_AGE_SECONDS),
            "probe_interval_seconds": float(settings.LINK_PROBE_INTERVAL_SECONDS),
            "links": rows,
        }
        return Response(self.Out(out).data)


class NodeDrainApi(APIView):
    """Stop assigning new work to the node. NODE_DRAINED is written when its current work ends."""

    @extend_schema(request=None, responses=NodeOut)
    def post(self, request: Request, node_id: NodeId) -> Response:
        get_object_or_404(Node, pk=node_id)
        node = node_drain(node_id=node_id, now=timezone.now())
        return Response(NodeOut(node).data)


class NodeUndrainApi(APIView):
    @extend_schema(request=None, responses=NodeOut)
    def post(self, request: Request, node_id: NodeId) -> Response:
        get_object_or_404(Node, pk=node_id)
        node = node_undrain(node_id=node_id, now=timezone.now())
        return Response(NodeOut(node).data)


class NodeRevokeApi(APIView):
    @extend_schema(request=None, responses=NodeOut)
    def post(self, request: Request, node_id: NodeId) -> Response:
        get_object_or_404(Node, pk=node_id)
        node_revoke(node_id=ids.node_id(node_id), now=timezone.now())
        return Response(NodeOut(Node.objects.get(pk=node_id)).data)


class NodeAllowReenrollApi(APIView):
    """Operator action: the node's machine may enroll once more without its credential (a rebuilt
    machine that lost its state directory), within NODE_REENROLL_WINDOW_SECONDS."""

    class Out(serializers.Serializer):
        node_id = serializers.UUIDField()
        window_seconds = serializers.IntegerField()

    @extend_schema(request=None, responses={200: Out, 404: AgentErrorSerializer})
    def post(self, request: Request, node_id: NodeId) -> Response:
        get_object_or_404(Node, pk=node_id)
        window = node_reenroll_allow(node_id=ids.node_id(node_id), now=timezone.now())
        return Response({"node_id": str(node_id), "window_seconds": window})


class TokenOut(serializers.ModelSerializer):
    status = serializers.SerializerMethodField()

    class Meta:
        model = EnrollmentToken
        fields = [
            "id",
            "label",
            "prefix",
            "account",
            "expires_at",
            "max_uses",
            "uses",
            "revoked_at",
            "created_at",
            "status",
        ]

    def get_status(self, obj: EnrollmentToken) -> str:
        return selectors.token_status(obj, now=timezone.now())


class TokenListCreateApi(APIView):
    class CreateIn(serializers.Serializer):
        label = serializers.CharField(max_length=120)  # type: ignore[assignment]  # a declared field; the metaclass moves it off the class
        ttl_hours = serializers.IntegerField(min_value=1, max_value=24 * 365, required=False)
        max_uses = serializers.IntegerField(min_value=1, max_value=10_000, default=1)
        account = serializers.UUIDField(
            required=False, help_text="account that will own the nodes; default: yours"
        )

    class CreatedOut(TokenOut):
        token = serializers.CharField()
        command = serializers.CharField(help_text="node-agent's command line (agent installed)")
        join_command = serializers.CharField(help_text="the one line: curl … | sh")
        join_python_command = serializers.CharField(help_text="the same without curl")

        class Meta(TokenOut.Meta):
            fields = [
                *TokenOut.Meta.fields,
                "token",
                "command",
                "join_command",
                "join_python_command",
            ]

    @extend_schema(responses=TokenOut(many=True))
    def get(self, request: Request) -> Response:
        return Response(TokenOut(EnrollmentToken.objects.all()[:500], many=True).data)

    @extend_schema(request=CreateIn, responses={201: CreatedOut})
    def post(self, request: Request) -> Response:
        data = self.CreateIn(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        account_id = v.get("account") or request_account_id(request)
        if not Account.objects.filter(pk=account_id).exists():
            return Response(
                {"error": {"message": f"unknown account {account_id}", "code": "not_found"}},
                status=404,
            )
        user = getattr(request.user, "_user", request.user)
        try:
            token, plaintext = enrollment_token_issue(
                account_id=account_id,
                label=v["label"],
                ttl_hours=v.get("ttl_hours"),
                max_uses=v["max_uses"],
                created_by_id=getattr(user, "pk", None),
                now=timezone.now(),
            )
        except EnrollmentError as exc:
            return Response(
                {"error": {"message": str(exc), "code": "enrollment_disabled"}}, status=409
            )
        out = dict(TokenOut(token).data)
        out["token"] = plaintext
        out["command"] = selectors.agent_command_line(token=plaintext)
        out["join_command"] = join.join_command_line(token=plaintext)
        out["join_python_command"] = join.join_python_line(token=plaintext)
        return Response(out, status=201)


class TokenRevokeApi(APIView):
    @extend_schema(request=None, responses=TokenOut)
    def post(self, request: Request, token_id: str) -> Response:
        get_object_or_404(EnrollmentToken, pk=token_id)
        return Response(
            TokenOut(enrollment_token_revoke(token_id=token_id, now=timezone.now())).data
        )


class EventListApi(GenericAPIView):
    """GET /api/admin/events?kind=&category=&node=&job=&deployment=&since=&until=&limit="""

    queryset = Event.objects.all()
    filter_backends = [DjangoFilterBackend]
    filterset_class = EventFilter
    pagination_class = LimitPagination

    @extend_schema(responses=EventOut(many=True))
    def get(self, request: Request) -> Response:
        events = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(EventOut(events, many=True).data)


_ = sync_to_async
