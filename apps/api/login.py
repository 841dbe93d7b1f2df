"""The web UI's sign-in: Django's LoginView, throttled per client address and username."""

from __future__ import annotations

import hashlib
from typing import Any

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.utils.http import url_has_allowed_host_and_scheme

from racon.redis import get_redis


def _failures_key(request: HttpRequest, username: str) -> str:
    who = f"{request.META.get('REMOTE_ADDR', '')}|{username.strip().lower()}"
    return "racon:login:failures:" + hashlib.sha256(who.encode()).hexdigest()[:32]


def safe_next(request: HttpRequest, target: str | None, fallback: str) -> str:
    """``target`` if it points into this site (same host, and https when the request is), else ``fallback``."""
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}, require_https=request.is_secure()):
        return target
    return fallback


class ThrottledLoginView(auth_views.LoginView):
    """After LOGIN_MAX_FAILURES failed sign-ins from one address for one username within
    LOGIN_FAILURE_WINDOW_SECONDS, further attempts get 429 until the window passes.

    The ``next=`` redirect is limited to this site (LoginView's own url_has_allowed_host_and_scheme).
    """

    template_name = "ui/login.html"
    redirect_authenticated_user = True

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        key = _failures_key(request, request.POST.get("username", ""))
        failures = int(get_redis().get(key) or 0)
        if failures >= settings.LOGIN_MAX_FAILURES:
            ttl = max(int(get_redis().ttl(key)), 1)
            context = self.get_context_data(form=self.get_form())
            context["throttled"] = f"Too many failed sign-ins. Try again in {ttl} seconds."
            response = self.render_to_response(context, status=429)
            response["Retry-After"] = str(ttl)
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form: Any) -> HttpResponse:
        key = _failures_key(self.request, self.request.POST.get("username", ""))
        # The window starts at the first failure (SET NX EX; INCR keeps the TTL). Redis 6.2, the
        # embedded one, has no EXPIRE … NX.
        with get_redis().pipeline(transaction=True) as pipe:
            pipe.set(key, 0, nx=True, ex=settings.LOGIN_FAILURE_WINDOW_SECONDS)
            pipe.incr(key)
            pipe.execute()
        return super().form_invalid(form)

    def form_valid(self, form: Any) -> HttpResponse:
        get_redis().delete(_failures_key(self.request, self.request.POST.get("username", "")))
        return super().form_valid(form)
