"""Versions match: each side refuses a node protocol it does not speak, naming both versions."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from agent import __version__, lifecycle
from agent.config import AgentConfig
from agent.protocol import PROTOCOL_VERSION
from agent.state import FatalAgentError
from tests.nodes.test_enrollment import enroll_body, issue


@pytest.mark.django_db
def test_the_controller_refuses_an_agent_of_another_protocol(client: Client) -> None:
    resp = client.post(
        "/api/agent/enroll",
        enroll_body(issue(), protocol_version=PROTOCOL_VERSION + 1, agent_version="9.0.0"),
        content_type="application/json",
    )
    assert resp.status_code == 409
    err = resp.json()["error"]
    assert err["code"] == "protocol_unsupported"
    assert f"protocol {PROTOCOL_VERSION}" in err["message"]
    assert f"9.0.0 speaks protocol {PROTOCOL_VERSION + 1}" in err["message"]
    assert "node-agent upgrade" in err["message"]


@pytest.mark.django_db
def test_the_controller_answers_with_its_protocol_and_accepts_an_agent_without_one(
    client: Client,
) -> None:
    body = enroll_body(issue())
    body.pop("protocol_version", None)
    resp = client.post("/api/agent/enroll", body, content_type="application/json")
    assert resp.status_code == 201 and resp.json()["protocol_version"] == PROTOCOL_VERSION


class Answers:
    def __init__(self, protocol_version: int) -> None:
        self.protocol_version = protocol_version

    def enroll(self, req: Any, **kw: Any) -> dict[str, Any]:
        assert req["protocol_version"] == PROTOCOL_VERSION
        return {
            "node_id": "n1", "credential": "c", "redis_url": "redis://x", "heartbeat_interval": 1.0,
            "state": "REGISTERING", "protocol_version": self.protocol_version,
        }  # fmt: skip


def test_the_agent_refuses_a_controller_of_another_protocol(tmp_path: Path) -> None:
    config = AgentConfig(
        controller_url="http://127.0.0.1:1",
        node_name="n",
        state_dir=tmp_path,
        models_dir=tmp_path / "models",
        advertise_address="127.0.0.1",
        enrollment_token="rcn_x",
    )
    with pytest.raises(FatalAgentError) as exc:
        lifecycle.enroll(
            Answers(PROTOCOL_VERSION + 1),  # type: ignore[arg-type]
            config,
            hardware={},  # type: ignore[typeddict-item]
            models=[],
            stored=None,
            stop=threading.Event(),
        )
    message = str(exc.value)
    assert f"controller speaks node protocol {PROTOCOL_VERSION + 1}" in message
    assert f"this agent ({__version__}) speaks protocol {PROTOCOL_VERSION}" in message
    assert not (tmp_path / "identity.json").exists()
