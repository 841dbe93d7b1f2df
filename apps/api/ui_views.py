"""Web UI views (HTMX). Thin: each reads through ``ui_render`` or writes through one app service.

Permissions are enforced here, on the server: every view needs a signed-in user, operator pages
need staff (403 otherwise), and reads are scoped to the viewer's account in ``ui_render`` (a
contributor asking for another account's node, job or receipt gets 404).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from functools import wraps
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.staticfiles.views import serve as staticfiles_serve
from django.core.exceptions import PermissionDenied
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_GET, require_POST

from apps.accounts.models import ApiKey
from apps.api import ui_charts, ui_events, ui_render
from apps.api.auth import api_key_create, api_key_revoke
from apps.api.login import safe_next
from apps.api.v1 import views as v1_views
from apps.credits.ledger import account_for_user
from apps.credits.receipts import receipt_check
from apps.jobs import deployments as deployment_services
from apps.jobs import jobs as job_services
from apps.jobs.deployments import deployment_create, placement_request_from
from apps.jobs.jobs import DeploymentError
from apps.jobs.scheduler import PlacementRefused
from apps.models_repo import services as model_services
from apps.models_repo.models import Model
from apps.nodes import services as node_services
from apps.nodes.enrollment import EnrollmentError, enrollment_token_issue, enrollment_token_revoke
from apps.nodes.join import join_command_line, join_python_line
from apps.nodes.models import EnrollmentToken, Node
from apps.nodes.selectors import agent_command_line
from racon import ids
from racon.ids import DeploymentId, JobId, NodeId

log = logging.getLogger("racon.ui")


def _wants_partial(request: HttpRequest) -> bool:
    htmx = getattr(request, "htmx", None)
    if not htmx:
        return False
    # A history restore (back button after hx-push-url) needs the whole page again.
    return not htmx.history_restore_request


def render_ui(
    request: HttpRequest,
    template: str,
    context: dict[str, Any],
    *,
    partial: str | None = None,
    status: int = 200,
) -> HttpResponse:
    """The one place that picks the page or, for an htmx request, just ``template#partial``."""
    name = f"{template}#{partial}" if partial and _wants_partial(request) else template
    resp = render(request, name, context, status=status)
    # The same URL answers a page or a fragment: caches must keep them apart.
    patch_vary_headers(resp, ("HX-Request",))
    return resp


def staff_required(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    """Signed in and staff; a contributor gets 403 (the operator pages exist, they just may not use them)."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not request.user.is_staff:
            raise PermissionDenied("operators only")
        return view(request, *args, **kwargs)

    return wrapper


def _back(request: HttpRequest, fallback: str) -> HttpResponse:
    # Only back into this site: a posted next= must not send the operator elsewhere.
    return redirect(safe_next(request, request.POST.get("next"), fallback))


# --- static files ----------------------------------------------------------------------------------


def static(request: HttpRequest, path: str) -> HttpResponseBase:
    """Vendored htmx, our CSS and JS. daphne serves no static files; a reverse proxy in front may
    serve STATIC_ROOT instead, but a bare controller must still show a working UI."""
    resp = staticfiles_serve(request, path, insecure=True)
    resp["Cache-Control"] = "public, max-age=300"
    return resp


# --- dashboard --------------------------------------------------------------------------------------


@login_required
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    if _wants_partial(request):
        return render_ui(
            request,
            "ui/dashboard.html",
            ui_render.dashboard_stats(user=request.user, now=timezone.now()),
            partial="stats",
        )
    now = timezone.now()
    viewer = ui_render.viewer_for(request.user)
    return render_ui(
        request,
        "ui/dashboard.html",
        {
            **ui_render.dashboard_page(user=request.user, now=now),
            **ui_render.machines_panel(viewer=viewer, now=now),
            "charts": ui_charts.dashboard_charts(viewer=viewer, now=now),
            "earnings_charts": ui_charts.earnings_chart(viewer=viewer, now=now)
            if not viewer.is_staff
            else [],
            "feed": ui_events.event_feed(viewer=viewer, limit=15),
        },
    )


@login_required
@require_GET
def events_page(request: HttpRequest) -> HttpResponse:
    """The event feed, filtered by kind and node (the dashboard's and node page's filters land here)."""
    q = request.GET
    try:
        limit = max(5, min(200, int(q.get("limit") or 50)))
    except ValueError:
        limit = 50
    feed = ui_events.event_feed(
        viewer=ui_render.viewer_for(request.user),
        kind=q.get("kind", ""),
        node=q.get("node", ""),
        limit=limit,
    )
    feed["full_page"] = not _wants_partial(request)
    return render_ui(request, "ui/events.html", {"feed": feed}, partial="feed")


# --- nodes -------------------------------------------------------------------------------------------


@login_required
@require_GET
def node_list(request: HttpRequest) -> HttpResponse:
    ctx = ui_render.node_list_page(
        user=request.user, state=request.GET.get("state"), now=timezone.now()
    )
    return render_ui(request, "ui/nodes/list.html", ctx, partial="node-table")


@login_required
@require_GET
def node_links(request: HttpRequest) -> HttpResponse:
    ctx = ui_render.node_links_page(user=request.user, now=timezone.now())
    return render_ui(request, "ui/nodes/links.html", ctx, partial="link-matrix")


@login_required
@require_GET
def node_detail(request: HttpRequest, node_id: NodeId) -> HttpResponse:
    now = timezone.now()
    viewer = ui_render.viewer_for(request.user)
    ctx = ui_render.node_detail_page(user=request.user, node_id=node_id, now=now)
    node = ctx["node"]
    feed = ui_events.event_feed(viewer=viewer, node_id=ids.node_id(node.id), limit=30)
    feed["fixed_node"] = node.name
    return render_ui(
        request,
        "ui/nodes/detail.html",
        {**ctx, "charts": ui_charts.node_charts(viewer=viewer, node=node, now=now), "feed": feed},
    )


def _node_action(
    request: HttpRequest, node_id: NodeId, action: Callable[..., Node]
) -> HttpResponse:
    ui_render.node_for(ui_render.viewer_for(request.user), node_id)  # 404 before anything moves
    node = action(node_id=node_id, now=timezone.now())
    if getattr(request, "htmx", False):
        # The new buttons, plus the badge out of band: the page shows the change even before the
        # dashboard socket's broadcast arrives.
        ctx = {"node": node, "is_staff": True}
        html = render_to_string("ui/nodes/list.html#node-actions", ctx, request) + render_to_string(
            "ui/nodes/list.html#node-badge", {**ctx, "oob": True}
        )
        return HttpResponse(html)
    return _back(request, f"/nodes/{node_id}/")


@staff_required
@require_POST
def node_drain(request: HttpRequest, node_id: NodeId) -> HttpResponse:
    return _node_action(request, node_id, node_services.node_drain)


@staff_required
@require_POST
def node_undrain(request: HttpRequest, node_id: NodeId) -> HttpResponse:
    return _node_action(request, node_id, node_services.node_undrain)


# --- enrollment tokens --------------------------------------------------------------------------


@staff_required
def token_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        return token_create(request)
    return render_ui(
        request,
        "ui/tokens/list.html",
        ui_render.token_list_page(now=timezone.now()),
        partial="token-table",
    )


def token_create(request: HttpRequest) -> HttpResponse:
    label = (request.POST.get("label") or "").strip()[:120] or "web"
    try:
        ttl = int(request.POST.get("ttl_hours") or 0) or None
        max_uses = max(1, min(10_000, int(request.POST.get("max_uses") or 1)))
    except ValueError:
        return render_ui(
            request,
            "ui/tokens/list.html",
            {
                **ui_render.token_list_page(now=timezone.now()),
                "error": "TTL and uses must be whole numbers",
            },
            partial="token-created",
            status=422,
        )
    try:
        token, plaintext = enrollment_token_issue(
            account_id=ids.account_id(account_for_user(user=request.user).id),
            label=label,
            ttl_hours=ttl,
            max_uses=max_uses,
            created_by_id=request.user.pk,
            now=timezone.now(),
        )
    except (EnrollmentError, ValueError) as exc:
        return render_ui(
            request,
            "ui/tokens/list.html",
            {**ui_render.token_list_page(now=timezone.now()), "error": str(exc)},
            partial="token-created",
            status=422,
        )
    # The plaintext exists only in this one response: it is never stored and never shown again.
    ctx = {
        **ui_render.token_list_page(now=timezone.now()),
        "created": token,
        "command": agent_command_line(token=plaintext),
        "join_command": join_command_line(token=plaintext),
        "join_python_command": join_python_line(token=plaintext),
    }
    return render_ui(request, "ui/tokens/list.html", ctx, partial="token-created")


@staff_required
@require_POST
def token_revoke(request: HttpRequest, token_id: str) -> HttpResponse:
    if not EnrollmentToken.objects.filter(pk=token_id).exists():
        return HttpResponse("no such token", status=404)
    enrollment_token_revoke(token_id=token_id, now=timezone.now())
    if getattr(request, "htmx", False):
        return render(
            request,
            "ui/tokens/list.html#token-table",
            ui_render.token_list_page(now=timezone.now()),
        )
    return redirect("/tokens/")


# --- models -----------------------------------------------------------------------------------------


@staff_required
def model_list(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return render_ui(
            request, "ui/models/list.html", ui_render.model_list_page(), partial="model-table"
        )
    path = (request.POST.get("path") or "").strip()
    pypi = (request.POST.get("pypi") or "").strip()
    name = (request.POST.get("name") or "").strip() or None
    error = ""
    if bool(path) == bool(pypi):
        error = "Give either a GGUF path on the controller or a PyPI package, not both."
    else:
        try:
            if path:
                model_services.model_register_file(path=path, name=name, now=timezone.now())
            else:
                model_services.model_register_from_pypi(package=pypi, name=name, now=timezone.now())
        except model_services.ModelRegistrationError as exc:
            error = str(exc)
    ctx = {**ui_render.model_list_page(), "error": error, "registered": not error}
    return render_ui(
        request, "ui/models/list.html", ctx, partial="model-section", status=422 if error else 200
    )


# --- deployments -------------------------------------------------------------------------------


def _placement_input(request: HttpRequest) -> tuple[Model | None, dict[str, Any], str]:
    """The deploy form as the placement request the REST API takes (nodes named by id)."""
    model = Model.objects.filter(name=request.POST.get("model", "")).first()
    if model is None:
        return None, {}, "Choose a registered model."
    try:
        n_ctx = int(request.POST.get("n_ctx") or 2048)
    except ValueError:
        return model, {}, "n_ctx must be a whole number."
    if not 128 <= n_ctx <= 1_048_576:
        return model, {}, "n_ctx must be between 128 and 1048576."
    data: dict[str, Any] = {"n_ctx": n_ctx}
    if request.POST.get("n_parallel"):
        try:
            data["n_parallel"] = int(request.POST["n_parallel"])
        except ValueError:
            return model, {}, "n_parallel must be a whole number."
        if not 1 <= data["n_parallel"] <= 64:
            return (
                model,
                {},
                "n_parallel must be between 1 and 64 (leave it empty: as many as memory allows).",
            )
    nodes = [n for n in request.POST.getlist("nodes") if n]
    if nodes and Node.objects.filter(pk__in=nodes).count() != len(set(nodes)):
        return model, {}, "Unknown node in the selection."
    engine = request.POST.get("engine") or ""
    if engine not in ("", "llamacpp", "vllm"):
        return model, {}, "engine must be llamacpp, vllm, or empty (the scheduler's choice)."
    why = deployment_services.engine_unavailable(model, engine)
    if why is not None:
        return model, {}, why[0].upper() + why[1:] + "."
    return (
        model,
        {
            **data,
            "engine": engine or "auto",  # empty: the scheduler chooses, and the preview says why
            "nodes": nodes,
            "spread": request.POST.get("spread") == "on",
            "allow_same_node": request.POST.get("allow_same_node") == "on",
        },
        "",
    )


@staff_required
@require_POST
def deployment_preview(request: HttpRequest) -> HttpResponse:
    model, data, error = _placement_input(request)
    ctx: dict[str, Any] = {"error": error}
    if not error and model is not None:
        try:
            planned, mf, _ = deployment_services.deployment_plan(
                model=model, request=placement_request_from(data)
            )
        except PlacementRefused as exc:
            ctx["error"] = exc.reason
        except DeploymentError:
            ctx["error"] = f"Model {model.name} has no registered file."
        else:
            plan = planned.to_dict()
            ctx.update(
                plan=plan,
                model=model,
                n_layer=mf.n_layer,
                bar=ui_render.placement_bar(plan, n_layer=mf.n_layer),
                explanation=ui_render.explanation(plan),
            )
    return render(
        request, "ui/deployments/list.html#preview", ctx, status=422 if ctx["error"] else 200
    )


@staff_required
def deployment_list(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return render_ui(
            request,
            "ui/deployments/list.html",
            ui_render.deployment_list_page(user=request.user),
            partial="dep-table",
        )
    model, data, error = _placement_input(request)
    if not error and model is not None:
        try:
            # Refuse impossible constraints up front, as the API does; an empty engine is
            # settled here, and the event says why.
            planned, _, req = deployment_services.deployment_plan(
                model=model, request=placement_request_from(data)
            )
            deployment_create(
                model=model,
                request=req,
                now=timezone.now(),
                engine_reason=planned.explanation[0] if data.get("engine") == "auto" else None,
            )
        except PlacementRefused as exc:
            error = exc.reason
        except DeploymentError as exc:
            error = str(exc)
    if not getattr(request, "htmx", False):
        if error:
            messages.error(request, error)
        return redirect("/deployments/")
    ctx = {
        **ui_render.deployment_list_page(user=request.user),
        "error": error,
        "deployed": not error,
    }
    return render(request, "ui/deployments/list.html#dep-table", ctx, status=422 if error else 200)


@staff_required
@require_POST
def deployment_stop(request: HttpRequest, deployment_id: DeploymentId) -> HttpResponse:
    ui_render.deployment_detail(deployment_id=deployment_id)
    dep = deployment_services.deployment_stop(
        deployment_id=deployment_id, now=timezone.now(), reason="stopped from the web UI"
    )
    if getattr(request, "htmx", False):
        return render(
            request,
            "ui/deployments/list.html#dep-row",
            {**ui_render.deployment_row(dep), "is_staff": True},
        )
    return redirect("/deployments/")


# --- jobs ---------------------------------------------------------------------------------------------


@login_required
@require_GET
def job_list(request: HttpRequest) -> HttpResponse:
    q = request.GET
    ctx = ui_render.job_list_page(
        user=request.user,
        state=q.get("state", ""),
        model=q.get("model", ""),
        node=q.get("node", ""),
    )
    return render_ui(request, "ui/jobs/list.html", ctx, partial="job-table")


@login_required
@require_GET
def job_detail(request: HttpRequest, job_id: JobId) -> HttpResponse:
    # htmx asks for just the nodes and layers that served it (the playground, after an answer).
    return render_ui(
        request,
        "ui/jobs/detail.html",
        ui_render.job_detail_page(user=request.user, job_id=job_id),
        partial="served-by",
    )


@login_required
@require_POST
def job_cancel(request: HttpRequest, job_id: JobId) -> HttpResponse:
    # A contributor may cancel their own job (they pay for it); staff may cancel any.
    ui_render.job_for(ui_render.viewer_for(request.user), job_id)
    job_services.job_cancel(job_id=job_id, now=timezone.now(), reason="cancelled from the web UI")
    return redirect(f"/jobs/{job_id}/")


# --- credits ---------------------------------------------------------------------------------------


@login_required
@require_GET
def credits_page(request: HttpRequest) -> HttpResponse:
    return render_ui(
        request,
        "ui/credits.html",
        ui_render.credits_page(
            user=request.user, account=request.GET.get("account"), now=timezone.now()
        ),
    )


@login_required
@require_POST
def receipt_verify(request: HttpRequest) -> HttpResponse:
    """Verify a listed receipt (by id) or a pasted receipt document against this controller's key."""
    receipt_id = request.POST.get("receipt_id")
    if receipt_id:
        document: Any = ui_render.receipt_for(user=request.user, receipt_id=receipt_id).document()
    else:
        try:
            document = json.loads(request.POST.get("document") or "")
        except ValueError as exc:
            return render(
                request,
                "ui/credits.html#verify-result",
                {"valid": False, "reason": f"not JSON: {exc}"},
                status=422,
            )
    result = receipt_check(receipt=document)
    return render(
        request,
        "ui/credits.html#verify-result",
        {"valid": result.valid, "reason": result.reason, "receipt_id": receipt_id},
    )


# --- playground ---------------------------------------------------------------------------------


@login_required
@require_GET
def playground(request: HttpRequest) -> HttpResponse:
    return render_ui(request, "ui/playground.html", ui_render.playground_page())


def _ephemeral_key(user: Any) -> tuple[Any, str]:
    return api_key_create(
        name="playground (web session)",
        account_id=ids.account_id(account_for_user(user=user).id),
        scopes=[ApiKey.SCOPE_INFERENCE],
        user_id=user.pk,
    )


async def playground_chat(request: HttpRequest) -> HttpResponseBase:
    """POST the OpenAI chat body here with the session cookie and CSRF token; the answer is /v1's own.

    /v1 takes only bearer keys. Rather than hand the browser a key, this view mints an
    inference-only key for the user's own account (stored hashed like every key), passes the
    request to the /v1 view in-process, and revokes the key the moment the response (or the
    stream) ends. No secret ever reaches the page, usage is billed to the user's account, and a
    leaked page or log holds nothing reusable.
    """
    user = await request.auser()
    if not user.is_authenticated:
        return JsonResponse(
            {
                "error": {
                    "message": "sign in first",
                    "type": "invalid_request_error",
                    "code": "not_authenticated",
                }
            },
            status=401,
        )
    if request.method != "POST":
        return JsonResponse(
            {
                "error": {
                    "message": "use POST",
                    "type": "invalid_request_error",
                    "code": "method_not_allowed",
                }
            },
            status=405,
        )
    key, plaintext = await sync_to_async(_ephemeral_key)(user)
    request.META["HTTP_AUTHORIZATION"] = f"Bearer {plaintext}"
    request.__dict__.pop(
        "headers", None
    )  # HttpRequest.headers is cached; the /v1 view must see the key
    revoke = sync_to_async(api_key_revoke)
    try:
        resp = await v1_views.chat_completions(
            request
        )  # the /v1 view itself: the playground is the API
    except BaseException:
        await revoke(key_id=key.id)
        raise
    if not isinstance(resp, StreamingHttpResponse):
        await revoke(key_id=key.id)
        return resp

    source = resp.streaming_content

    async def revoke_after() -> AsyncIterator[bytes]:
        try:
            # /v1 streams asynchronously; Django's type also allows a plain iterator.
            if not isinstance(source, AsyncIterator):
                raise TypeError("the /v1 view's stream is not asynchronous")
            async for chunk in source:
                yield chunk
        finally:
            await revoke(key_id=key.id)

    resp.streaming_content = revoke_after()
    return resp
