"""Web UI for API keys (every user: their own) and contributor accounts (operators), plus the
invite page where an invited user sets a password. Thin: each write is one service call, the same
services the REST API (apps.accounts.api) calls."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts import selectors as account_selectors
from apps.accounts import services as account_services
from apps.accounts.api import account_limit_defaults, invite_url, key_limit_defaults
from apps.accounts.models import ApiKey
from apps.credits.ledger import account_for_user
from apps.credits.selectors import account_summary, key_usage
from racon import ids
from racon.ids import ApiKeyId

from .ui_views import render_ui, staff_required

# The playground mints one short-lived key per request; they are revoked at once and would only
# crowd the list.
PLAYGROUND_KEY_NAME = "playground (web session)"


def _keys_page(*, user: Any, now: Any) -> dict[str, Any]:
    account = account_for_user(user=user)
    usage = {u["key"]: u for u in key_usage(account_id=ids.account_id(account.id))}
    keys = [
        {"key": k, "status": account_selectors.key_status(k, now=now), "usage": usage.get(k.pk)}
        for k in account_selectors.key_list(account_id=ids.account_id(account.id))
        if k.name != PLAYGROUND_KEY_NAME
    ]
    return {
        "account": account,
        "keys": keys,
        "usage_total": {
            "tokens": sum(u["total_tokens"] for u in usage.values()),
            "credits": sum(u["credits"] for u in usage.values()),
        },
        "scopes": [s for s in ApiKey.SCOPES if s != ApiKey.SCOPE_ADMIN or user.is_staff],
        "limits": key_limit_defaults(),
        "account_limits": {
            f: (d if getattr(account, f) is None else getattr(account, f))
            for f, d in account_limit_defaults().items()
        },
        "standing": account_summary(account_id=ids.account_id(account.id), now=now),
        "prompt_retention_days": settings.JOB_PARAMS_RETENTION_DAYS,
    }


@login_required
def key_list(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    if request.method != "POST":
        return render_ui(
            request,
            "ui/keys/list.html",
            _keys_page(user=request.user, now=now),
            partial="key-table",
        )
    name = (request.POST.get("name") or "").strip()[:120] or "web"
    scopes = request.POST.getlist("scopes") or [ApiKey.SCOPE_INFERENCE]
    try:
        days = int(request.POST.get("expires_in_days") or 0)
        key, plaintext = account_services.key_create(
            name=name,
            account_id=ids.account_id(account_for_user(user=request.user).id),
            scopes=scopes,
            user_id=request.user.pk,
            expires_at=now + timedelta(days=days) if days > 0 else None,
            now=now,
        )
    except ValueError as exc:
        ctx = {**_keys_page(user=request.user, now=now), "error": str(exc)}
        return render_ui(request, "ui/keys/list.html", ctx, partial="key-created", status=422)
    # The plaintext exists only in this one response: it is never stored and never shown again.
    ctx = {**_keys_page(user=request.user, now=now), "created": key, "secret": plaintext}
    return render_ui(request, "ui/keys/list.html", ctx, partial="key-created")


@login_required
@require_POST
def key_revoke(request: HttpRequest, key_id: ApiKeyId) -> HttpResponse:
    account = account_for_user(user=request.user)
    try:
        account_selectors.key_get(key_id=key_id, account_id=ids.account_id(account.id))
    except ApiKey.DoesNotExist:
        return HttpResponse("no such key", status=404)
    now = timezone.now()
    account_services.key_revoke(key_id=key_id, now=now)
    if getattr(request, "htmx", False):
        return render(
            request, "ui/keys/list.html#key-table", _keys_page(user=request.user, now=now)
        )
    return redirect("/keys/")


@staff_required
def account_list(request: HttpRequest) -> HttpResponse:
    ctx: dict[str, Any] = {"accounts": list(account_selectors.account_list())}
    if request.method != "POST":
        return render_ui(request, "ui/accounts/list.html", ctx, partial="account-table")
    try:
        created = account_services.account_user_create(
            username=(request.POST.get("username") or "").strip(),
            email=(request.POST.get("email") or "").strip(),
            password=request.POST.get("password") or None,
            is_staff=request.POST.get("is_staff") == "on",
        )
    except (ValueError, ValidationError) as exc:
        msg = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
        return render_ui(
            request,
            "ui/accounts/list.html",
            {**ctx, "error": msg},
            partial="account-created",
            status=422,
        )
    ctx = {
        "accounts": list(account_selectors.account_list()),
        "created": created.account,
        "invite_url": invite_url(created.invite) if created.invite else None,
    }
    return render_ui(request, "ui/accounts/list.html", ctx, partial="account-created")


def invite(request: HttpRequest, uidb64: str, token: str) -> HttpResponse:
    """The invite link: set a password, then sign in. The link works once."""
    try:
        user = account_services.invite_user(uidb64=uidb64, token=token)
    except account_services.InviteInvalid as exc:
        return render(request, "ui/accounts/invite.html", {"invalid": str(exc)}, status=404)
    ctx: dict[str, Any] = {"username": user.username}
    if request.method == "POST":
        password = request.POST.get("password") or ""
        if password != request.POST.get("password2"):
            ctx["error"] = "The two passwords differ."
        else:
            try:
                account_services.invite_accept(uidb64=uidb64, token=token, password=password)
            except ValidationError as exc:
                ctx["error"] = " ".join(exc.messages)
            except account_services.InviteInvalid as exc:
                ctx["invalid"] = str(exc)
            else:
                return redirect("/login/?invited=1")
        return render(request, "ui/accounts/invite.html", ctx, status=422)
    return render(request, "ui/accounts/invite.html", ctx)
