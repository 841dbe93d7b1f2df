"""Versions match: each side refuses a node protocol it does not speak, naming both versions."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import Client

from agent import __version__, lifecycle
from agent.agent import Agent
from agent.client import ControllerClient
from agent.config import AgentConfig
from agent.protocol import (
    PROTOCOL_PATH,
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOL_VERSIONS,
    heartbeat_key,
)
from agent.state import EXIT_OK, EXIT_REFUSED, AgentState, FatalAgentError
from apps.nodes import api as nodes_api
from apps.nodes.models import EnrollmentToken, Event, Node
from apps.nodes.states import NodeState
from racon.redis import get_redis
from tests.agent.harness import fake_profile
from tests.factories import hardware_profile
from tests.support.enrollment import enroll_body, issue


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
def test_the_controller_answers_with_its_protocol_and_refuses_an_agent_without_one(
    client: Client,
) -> None:
    resp = client.post("/api/agent/enroll", enroll_body(issue()), content_type="application/json")
    assert resp.status_code == 201 and resp.json()["protocol_version"] == PROTOCOL_VERSION
    # An agent from before the field existed speaks protocol 1, whose errors were told apart by
    # their words: refused, naming the upgrade.
    body = enroll_body(issue())
    body.pop("protocol_version", None)
    resp = client.post("/api/agent/enroll", body, content_type="application/json")
    assert resp.status_code == 409, resp.content
    assert "speaks protocol 1" in resp.json()["error"]["message"]


class InProcess(httpx.BaseTransport):
    """This controller's WSGI application, in this thread (so in the test's transaction). As in
    Django's test client, a request does not close the test's database connection."""

    def __init__(self, *, without: str | None = None) -> None:
        self.wsgi = httpx.WSGITransport(app=get_wsgi_application())
        self.without = without  # a path this controller answers 404 (an older controller)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == self.without:
            return httpx.Response(404, json={"error": {"message": "not found"}})
        request_started.disconnect(close_old_connections)
        request_finished.disconnect(close_old_connections)
        try:
            resp = self.wsgi.handle_request(request)
            resp.read()  # Django's request_finished fires as the body closes: here, not later
            resp.close()
            return resp
        finally:
            request_started.connect(close_old_connections)
            request_finished.connect(close_old_connections)


def wsgi_client(*, without: str | None = None) -> ControllerClient:
    """The agent's own HTTP client, talking to this controller in-process (the test's database)."""
    return ControllerClient(
        "http://testserver", transport=InProcess(without=without), max_retries=0
    )


def agent_config(tmp_path: Path, token: str = "rcn_x") -> AgentConfig:
    return AgentConfig(
        controller_url="http://testserver",
        node_name="box-1",
        state_dir=tmp_path / "state",
        models_dir=tmp_path / "models",
        advertise_address="10.0.0.5",
        enrollment_token=token,
        hardware_profile=fake_profile(tmp_path),
        run_benchmarks=False,
    )


def agent_enroll(tmp_path: Path, token: str, *, without: str | None = None) -> Any:
    stop = threading.Event()
    # enroll retries an unreachable controller until stopped: a broken one ends the test in 60 s
    timer = threading.Timer(60, stop.set)
    timer.start()
    try:
        return _agent_enroll(tmp_path, token, without=without, stop=stop)
    finally:
        timer.cancel()


def _agent_enroll(tmp_path: Path, token: str, *, without: str | None, stop: threading.Event) -> Any:
    return lifecycle.enroll(
        wsgi_client(without=without),
        agent_config(tmp_path, token),
        hardware=hardware_profile(),  # type: ignore[arg-type]
        models=[],
        stored=None,
        stop=stop,
    )


@pytest.mark.django_db
def test_the_controller_reports_its_protocol_without_a_token(client: Client) -> None:
    resp = client.get("/api/agent/protocol")
    assert resp.status_code == 200
    assert resp.json() == {
        "protocol_version": PROTOCOL_VERSION,
        "supported_protocol_versions": list(SUPPORTED_PROTOCOL_VERSIONS),
    }


@pytest.mark.django_db
def test_a_refused_agent_protocol_leaves_the_token_unused(client: Client) -> None:
    token = issue(max_uses=1)
    refused = client.post(
        "/api/agent/enroll",
        enroll_body(token, protocol_version=PROTOCOL_VERSION + 1, agent_version="9.0.0"),
        content_type="application/json",
    )
    assert refused.status_code == 409
    assert EnrollmentToken.objects.get().uses == 0
    again = client.post("/api/agent/enroll", enroll_body(token), content_type="application/json")
    assert again.status_code == 201, again.content


@pytest.mark.django_db
def test_the_agent_refuses_a_controller_of_another_protocol_before_using_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = issue(max_uses=1)
    # A newer controller: speaks protocol N+1 (and would still accept this agent's N).
    monkeypatch.setattr(nodes_api, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    with pytest.raises(FatalAgentError) as exc:
        agent_enroll(tmp_path / "a", token)
    message = str(exc.value)
    assert f"controller speaks node protocol {PROTOCOL_VERSION + 1}" in message
    assert f"this agent ({__version__}) speaks protocol {PROTOCOL_VERSION}" in message
    assert "token was not used" in message and exc.value.refused
    assert not (tmp_path / "a" / "state" / "identity.json").exists()
    tok = EnrollmentToken.objects.get()
    assert tok.uses == 0 and not Node.objects.exists()

    monkeypatch.undo()  # the controller of this agent's protocol: the same token still enrolls
    enrolled = agent_enroll(tmp_path / "b", token)
    assert enrolled is not None
    identity, resp = enrolled
    assert Node.objects.filter(pk=identity.node_id).exists()
    assert resp["protocol_version"] == PROTOCOL_VERSION
    tok.refresh_from_db()
    assert tok.uses == 1


@pytest.mark.django_db
def test_the_agent_refuses_a_controller_without_the_protocol_endpoint_as_protocol_1(
    tmp_path: Path,
) -> None:
    # A controller from before the endpoint speaks 1, which told errors apart by their words:
    # this agent (protocol 2) refuses it before the token is used.
    nodes = Node.objects.count()
    with pytest.raises(FatalAgentError, match="speaks node protocol 1"):
        agent_enroll(tmp_path, issue(), without=PROTOCOL_PATH)
    assert Node.objects.count() == nodes


# --- the heartbeat -------------------------------------------------------------------------------


def enrolled_node(client: Client) -> tuple[str, str]:
    resp = client.post("/api/agent/enroll", enroll_body(issue()), content_type="application/json")
    assert resp.status_code == 201, resp.content
    return resp.json()["node_id"], resp.json()["credential"]


def beat(client: Client, node_id: str, credential: str, **body: Any) -> Any:
    body.setdefault("telemetry", {"cpu_percent": 5.0, "agent_version": "9.0.0"})
    return client.post(
        "/api/agent/heartbeat",
        body,
        content_type="application/json",
        headers={"Authorization": f"Node {node_id}:{credential}"},
    )


@pytest.mark.django_db
def test_the_controller_refuses_a_heartbeat_of_another_protocol_and_changes_nothing(
    client: Client,
) -> None:
    node_id, credential = enrolled_node(client)
    before = Node.objects.values().get(pk=node_id)
    events = Event.objects.count()
    resp = beat(client, node_id, credential, state="READY", protocol_version=PROTOCOL_VERSION + 1)
    assert resp.status_code == 409
    err = resp.json()["error"]
    assert err["code"] == "protocol_unsupported"
    assert f"this controller speaks node protocol {PROTOCOL_VERSION}" in err["message"]
    assert f"agent 9.0.0 speaks protocol {PROTOCOL_VERSION + 1}" in err["message"]
    assert Node.objects.values().get(pk=node_id) == before
    assert Event.objects.count() == events
    assert not get_redis().exists(heartbeat_key(node_id))

    bad = beat(client, node_id, credential, protocol_version="one")
    assert bad.status_code == 400 and "protocol_version" in bad.json()["error"]["fields"]

    ok = beat(client, node_id, credential, state="READY", protocol_version=PROTOCOL_VERSION)
    assert ok.status_code == 200 and ok.json()["protocol_version"] == PROTOCOL_VERSION
    assert ok.json()["state"] == NodeState.READY
    # An agent from before the field existed speaks 1: refused.
    assert beat(client, node_id, credential).status_code == 409


def heartbeating_agent(tmp_path: Path, client: Client) -> Agent:
    node_id, credential = enrolled_node(client)
    agent = Agent(agent_config(tmp_path), client=wsgi_client(), install_signals=False)
    agent.client.set_credentials(node_id, credential)
    return agent


@pytest.mark.django_db
def test_the_agent_stops_when_the_controller_refuses_its_heartbeat_protocol(
    tmp_path: Path, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = heartbeating_agent(tmp_path, client)
    # A controller that dropped this agent's protocol.
    monkeypatch.setattr(nodes_api, "SUPPORTED_PROTOCOL_VERSIONS", (PROTOCOL_VERSION + 1,))
    agent.heartbeat.beat()
    assert agent.exit_code == EXIT_REFUSED and agent.state == AgentState.ERROR
    assert agent.revoked  # nothing more is reported to a controller that refuses this agent


@pytest.mark.django_db
def test_the_agent_stops_when_a_heartbeat_answer_names_another_protocol(
    tmp_path: Path,
    client: Client,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = heartbeating_agent(tmp_path, client)
    agent.heartbeat.beat()
    assert agent.exit_code == EXIT_OK and agent.heartbeat.controller_state == "REGISTERING"
    monkeypatch.setattr(nodes_api, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    agent_log = logging.getLogger("agent")  # Django's LOGGING does not propagate it to root
    agent_log.addHandler(caplog.handler)
    try:
        agent.heartbeat.beat()
    finally:
        agent_log.removeHandler(caplog.handler)
    assert agent.exit_code == EXIT_REFUSED and agent.state == AgentState.ERROR
    assert f"controller speaks node protocol {PROTOCOL_VERSION + 1}" in caplog.text
    assert f"this agent ({__version__}) speaks protocol {PROTOCOL_VERSION}" in caplog.text
