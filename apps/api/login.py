"""The web UI's sign-in: Django's LoginView, throttled per client address and username, and per username."""

from __future__ import annotations

import hashlib
from typing import Any

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.utils.http import url_has_allowed_host_and_scheme

from racon.net import client_address
from racon.redis import get_redis


def _failures_keys(request: HttpRequest, username: str) -> list[tuple[str, int]]:
    """(counter key, limit) pairs: per client address and username, and per username alone, so
    that a guesser who rotates addresses is still stopped at LOGIN_MAX_FAILURES_PER_USER."""
    user = username.strip().lower()
    pairs = [
        (f"{client_address(request)}|{user}", settings.LOGIN_MAX_FAILURES),
        (f"*|{user}", settings.LOGIN_MAX_FAILURES_PER_USER),
    ]
    return [
        ("racon:login:failures:" + hashlib.sha256(who.encode()).hexdigest()[:32], limit)
        for who, limit in pairs
    ]


def safe_next(request: HttpRequest, target: str | None, fallback: str) -> str:
    """``target`` if it points into this site (same host, and https when the request is), else ``fallback``."""
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
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
        r = get_redis()
        for key, limit in _failures_keys(request, request.POST.get("username", "")):
            if int(r.get(key) or 0) >= limit:
                ttl = max(int(r.ttl(key)), 1)
                context = self.get_context_data(form=self.get_form())
                context["throttled"] = f"Too many failed sign-ins. Try again in {ttl} seconds."
                response = self.render_to_response(context, status=429)
                response["Retry-After"] = str(ttl)
                return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form: Any) -> HttpResponse:
        # The window starts at the first failure (SET NX EX; INCR keeps the TTL). Redis 6.2, the
        # embedded one, has no EXPIRE … NX.
        with get_redis().pipeline(transaction=True) as pipe:
            for key, _limit in _failures_keys(self.request, self.request.POST.get("username", "")):
                pipe.set(key, 0, nx=True, ex=settings.LOGIN_FAILURE_WINDOW_SECONDS)
                pipe.incr(key)
            pipe.execute()
        return super().form_invalid(form)

    def form_valid(self, form: Any) -> HttpResponse:
        # Only this address's counter is cleared: a correct password elsewhere does not reset the
        # per-username count another address is running up.
        get_redis().delete(
            _failures_keys(self.request, self.request.POST.get("username", ""))[0][0]
        )
        return super().form_valid(form)
