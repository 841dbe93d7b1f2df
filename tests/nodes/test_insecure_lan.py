"""A controller on a network that would hand secrets over an unauthenticated channel (issue 24):
a plain-http non-loopback controller gives no Redis URL at enrollment unless RACON_INSECURE_LAN=1,
and the controller itself (not only the launcher) refuses to start with an unsafe external Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from apps.nodes.models import EnrollmentToken, Node
from racon.lan import controller_redis_refusal
from tests.support.enrollment import enroll_body, issue, post

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.django_db
def test_a_plain_http_controller_on_a_network_hands_no_redis_url_at_enrollment(
    client: Client, settings: Any
) -> None:
    settings.CONTROLLER_PUBLIC_URL = "http://10.1.2.3:8000"
    settings.INSECURE_LAN = False
    body = enroll_body(issue())
    resp = post(client, body)
    assert resp.status_code == 403, resp.content
    error = resp.json()["error"]
    assert error["code"] == "insecure_lan" and "RACON_INSECURE_LAN=1" in error["message"]
    assert "redis_url" not in resp.json() and "credential" not in resp.json()
    # Nothing enrolled, and the token is not used up.
    assert Node.objects.count() == 0
    assert EnrollmentToken.objects.get().uses == 0
    settings.INSECURE_LAN = True
    ok = post(client, body)
    assert ok.status_code == 201, ok.content
    assert ok.json()["redis_url"].startswith("redis")
    # Loopback plain http (make run without BIND) is as before.
    settings.INSECURE_LAN = False
    settings.CONTROLLER_PUBLIC_URL = "http://127.0.0.1:8000"
    again = post(
        client,
        enroll_body(
            issue(), node_name="n2", machine_id="machine-bbb", advertise_address="10.0.0.6"
        ),
    )
    assert again.status_code == 201, again.content


def _setup(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RACON_"))}
    clean.update(DJANGO_SETTINGS_MODULE="racon.settings", **env)
    clean.pop("CELERY_BROKER_URL", None)
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); print('started')"],
        cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_controller_refuses_a_plaintext_redis_on_a_network() -> None:
    # A TEST-NET address: refused before any connection is tried (no TLS in the URL).
    for name in ("REDIS_URL", "RACON_AGENT_REDIS_URL"):
        out = _setup({name: "redis://192.0.2.7:6379/0"})
        said = out.stdout + out.stderr
        assert out.returncode != 0 and "started" not in out.stdout, said
        assert "the controller refuses to start" in said and name in said, said
        assert "rediss://" in said, said
    # RACON_INSECURE_LAN=1 (a trusted LAN) accepts it; loopback is left alone.
    insecure = _setup(
        {"RACON_AGENT_REDIS_URL": "redis://192.0.2.7:6379/0", "RACON_INSECURE_LAN": "1"}
    )
    assert insecure.returncode == 0 and "started" in insecure.stdout, insecure.stderr[-2000:]
    loopback = _setup({"RACON_AGENT_REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert loopback.returncode == 0 and "started" in loopback.stdout, loopback.stderr[-2000:]


def test_the_refusal_names_each_unsafe_url_and_the_way_out() -> None:
    said = controller_redis_refusal(
        {"REDIS_URL": "redis://127.0.0.1:6379/0", "RACON_AGENT_REDIS_URL": "redis://10.9.9.9/0"},
        insecure_lan=False,
    )
    assert (
        said is not None and "RACON_AGENT_REDIS_URL" in said and "REDIS_URL redis://127" not in said
    )
    assert "RACON_INSECURE_LAN=1" in said
    assert controller_redis_refusal({"REDIS_URL": "redis://10.9.9.9/0"}, insecure_lan=True) is None
