"""Operator actions on GPU challenges (apps/nodes/gpu_challenges.py): ask for one now, and clear
a failed one (which stands until an operator does)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from racon.ids import NodeId

from .api import AgentErrorSerializer
from .gpu_challenges import ChallengeRefused, node_gpu_challenge_clear, node_gpu_challenge_request
from .models import Node

_REFUSAL_STATUS = {
    "rate_limited": status.HTTP_429_TOO_MANY_REQUESTS,
    "gpu_challenge_failed": status.HTTP_409_CONFLICT,
    "nothing_to_challenge": status.HTTP_409_CONFLICT,
}


class GpuChallengeRequestSerializer(serializers.Serializer):
    device = serializers.RegexField(r"^[A-Za-z][A-Za-z_]{0,15}[0-9]{0,3}$", required=False)


class GpuChallengeQueuedSerializer(serializers.Serializer):
    node_id = serializers.UUIDField()
    device = serializers.CharField()
    queued = serializers.BooleanField()


class GpuChallengeClearedSerializer(serializers.Serializer):
    node_id = serializers.UUIDField()
    cleared = serializers.BooleanField()


class NodeGpuChallengeApi(APIView):
    """Challenge one unverified GPU of the node now (at most one challenge per node per
    GPU_CHALLENGE_INTERVAL_SECONDS; none while a failed one stands)."""

    @extend_schema(
        request=GpuChallengeRequestSerializer,
        responses={
            202: GpuChallengeQueuedSerializer,
            404: AgentErrorSerializer,
            409: AgentErrorSerializer,
            429: AgentErrorSerializer,
        },
    )
    def post(self, request: Request, node_id: NodeId) -> Response:
        get_object_or_404(Node, pk=node_id)
        body = GpuChallengeRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            device = node_gpu_challenge_request(
                node_id=node_id, device=body.validated_data.get("device"), now=timezone.now()
            )
        except ChallengeRefused as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            return Response(
                {"error": {"message": str(exc), "code": exc.code}},
                status=_REFUSAL_STATUS[exc.code],
                headers=headers,
            )
        return Response(
            {"node_id": str(node_id), "device": device, "queued": True},
            status=status.HTTP_202_ACCEPTED,
        )


class NodeGpuChallengeClearApi(APIView):
    """Clear the node's GPU challenge record: a failed challenge no longer stands and the rate
    limit is lifted; its GPUs stay at the floor until a challenge passes."""

    @extend_schema(
        request=None, responses={200: GpuChallengeClearedSerializer, 404: AgentErrorSerializer}
    )
    def post(self, request: Request, node_id: NodeId) -> Response:
        get_object_or_404(Node, pk=node_id)
        cleared = node_gpu_challenge_clear(node_id=node_id, now=timezone.now())
        return Response({"node_id": str(node_id), "cleared": cleared})
