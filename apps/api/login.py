"""The web UI's sign-in and the django-admin's: throttled per (client address, username), and per
client address over all usernames; never per username alone (issue 28: 50 failures from anywhere
locked the operator out)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.utils.http import url_has_allowed_host_and_scheme

from racon.net import client_address
from racon.redis import get_redis


def _failures_keys(request: HttpRequest, username: str) -> list[tuple[str, int]]:
    """(counter key, limit) pairs: per client address and username, and per client address over
    every username (one address spraying names). A lock-out is never per username alone: failures
    from other addresses cannot lock the operator out of their own."""
    user = username.strip().lower()
    address = client_address(request)
    pairs = [
        (f"{address}|{user}", settings.LOGIN_MAX_FAILURES),
        (f"{address}|*", settings.LOGIN_MAX_FAILURES_PER_ADDRESS),
    ]
    return [
        ("racon:login:failures:" + hashlib.sha256(who.encode()).hexdigest()[:32], limit)
        for who, limit in pairs
    ]


def login_throttled(request: HttpRequest) -> int:
    """Seconds until this address may try this username again (0: it may now)."""
    r = get_redis()
    for key, limit in _failures_keys(request, request.POST.get("username", "")):
        if int(r.get(key) or 0) >= limit:
            return max(int(r.ttl(key)), 1)
    return 0


def login_failed(request: HttpRequest) -> None:
    """Count a failed sign-in. The window starts at the first failure (SET NX EX; INCR keeps the
    TTL). Redis 6.2, the embedded one, has no EXPIRE … NX."""
    with get_redis().pipeline(transaction=True) as pipe:
        for key, _limit in _failures_keys(request, request.POST.get("username", "")):
            pipe.set(key, 0, nx=True, ex=settings.LOGIN_FAILURE_WINDOW_SECONDS)
            pipe.incr(key)
        pipe.execute()


def login_succeeded(request: HttpRequest) -> None:
    """Only this address's count for this username is cleared."""
    get_redis().delete(_failures_keys(request, request.POST.get("username", ""))[0][0])


def admin_login_throttled(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """The django-admin's login view (AdminSite.login) with /login/'s throttle: a POST past the
    limit is 429 without checking the password; a POST answered with the form again (200) is a
    failure, a redirect a success."""

    @functools.wraps(view)
    def login(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        wait = login_throttled(request)
        if wait:
            response = HttpResponse(
                f"Too many failed sign-ins. Try again in {wait} seconds.\n",
                status=429,
                content_type="text/plain; charset=utf-8",
            )
            response["Retry-After"] = str(wait)
            return response
        response = view(request, *args, **kwargs)
        if response.status_code == 200:
            login_failed(request)
        elif 300 <= response.status_code < 400:
            login_succeeded(request)
        return response

    return login


def safe_next(request: HttpRequest, target: str | None, fallback: str) -> str:
    """``target`` if it points into this site (same host, and https when the request is), else ``fallback``."""
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return fallback


class ThrottledLoginView(auth_views.LoginView):
    """After LOGIN_MAX_FAILURES failed sign-ins from one address for one username (or
    LOGIN_MAX_FAILURES_PER_ADDRESS from one address for any) within LOGIN_FAILURE_WINDOW_SECONDS,
    further attempts from that address get 429 until the window passes.

    The ``next=`` redirect is limited to this site (LoginView's own url_has_allowed_host_and_scheme).
    """

    template_name = "ui/login.html"
    redirect_authenticated_user = True

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        wait = login_throttled(request)
        if wait:
            context = self.get_context_data(form=self.get_form())
            context["throttled"] = f"Too many failed sign-ins. Try again in {wait} seconds."
            response = self.render_to_response(context, status=429)
            response["Retry-After"] = str(wait)
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form: Any) -> HttpResponse:
        login_failed(self.request)
        return super().form_invalid(form)

    def form_valid(self, form: Any) -> HttpResponse:
        login_succeeded(self.request)
        return super().form_valid(form)
