"""/api/agent/kv/<transfer>: a KV state transfer's blob, uploaded by the old owner's primary and
downloaded by the new owner's, each with its node credential (apps/jobs/kvtransfer.py)."""

from __future__ import annotations

from django.http import FileResponse, HttpRequest, JsonResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from apps.nodes.api import parse_node_auth
from apps.nodes.enrollment import NodeAuthError, node_authenticate
from racon import ids

from . import kvtransfer


def _error(message: str, status: int, *, code: str | None = None) -> JsonResponse:
    body: dict[str, str] = {"message": message}
    if code:
        body["code"] = code
    return JsonResponse({"error": body}, status=status)


@csrf_exempt  # node-authenticated by its credential header, never by a browser session
@require_http_methods(["GET", "POST"])
def kv_blob(request: HttpRequest, transfer_id: str) -> HttpResponseBase:
    """POST: the old owner uploads the saved slot (raw body). GET: the new owner downloads it."""
    creds = parse_node_auth(request.headers.get("Authorization", ""))
    try:
        if creds is None:
            raise NodeAuthError("missing node credential", code="missing_credential")
        node = node_authenticate(node_id=creds[0], credential=creds[1])
    except (NodeAuthError, ValueError) as exc:
        return _error(str(exc), 401, code=getattr(exc, "code", "invalid_credential"))
    try:
        if request.method == "POST":
            length = request.headers.get("Content-Length")
            if length is not None and not length.isdigit():
                return _error(f"Content-Length: {length!r} is not a byte count", 400)
            accepted = kvtransfer.kv_upload_accept(
                transfer_id=transfer_id,
                node_id=ids.node_id(node.id),
                body=request,  # type: ignore[arg-type]  # HttpRequest.read is file-like
                content_length=int(length) if length is not None else None,
            )
            return JsonResponse(accepted, status=201)
        path, size, sha = kvtransfer.kv_download_open(
            transfer_id=transfer_id, node_id=ids.node_id(node.id)
        )
    except kvtransfer.TransferRefused as exc:
        return _error(str(exc), exc.status)
    resp = FileResponse(
        open(path, "rb"), content_type="application/octet-stream"
    )  # FileResponse closes it
    resp["Content-Length"] = str(size)
    resp["X-Racon-Sha256"] = sha
    return resp
