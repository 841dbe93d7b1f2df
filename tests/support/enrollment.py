"""The agent's enrollment call as the tests make it: a body, a token, the POST."""

from __future__ import annotations

from typing import Any

from django.test import Client
from django.utils import timezone

from agent.protocol import PROTOCOL_VERSION
from apps.nodes.enrollment import enrollment_token_issue
from racon import ids
from tests.factories import AccountFactory, hardware_profile


def enroll_body(token: str, **over: Any) -> dict[str, Any]:
    body = {
        "token": token,
        "node_name": "box-1",
        "machine_id": "machine-aaa",
        "agent_version": "0.1.0",
        "protocol_version": PROTOCOL_VERSION,
        "advertise_address": "10.0.0.5",
        "rpc_port": 50052,
        "hardware": hardware_profile(
            gpus=[
                {
                    "index": 0,
                    "vendor": "NVIDIA",
                    "name": "RTX 3060",
                    "uuid": "GPU-1",
                    "vram_total": 12 * 1024**3,
                    "vram_free": 11 * 1024**3,
                    "driver": "550.1",
                }
            ]
        ),
    }
    body.update(over)
    return body


def issue(**kw: Any) -> str:
    acct = kw.pop("account", None) or AccountFactory()
    _, plaintext = enrollment_token_issue(
        account_id=ids.account_id(acct.id), label="t", now=timezone.now(), **kw
    )
    return plaintext


def post(client: Client, body: Any) -> Any:
    return client.post("/api/agent/enroll", body, content_type="application/json")
