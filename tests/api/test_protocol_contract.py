"""agent/protocol.py is the wire contract; the controller's serializers must agree with it."""

from __future__ import annotations

from typing import Any, get_type_hints

import pytest
from rest_framework import serializers

from agent import protocol
from agent.protocol import PROTOCOL_VERSION
from apps.nodes import api as nodes_api


def keys(td: Any) -> tuple[set[str], set[str]]:
    """(required, optional) keys of a TypedDict, reading NotRequired from the resolved hints.

    (With postponed annotations, __required_keys__ cannot see NotRequired.)
    """
    from typing import NotRequired, get_origin

    hints = get_type_hints(td, include_extras=True)
    optional = {k for k, v in hints.items() if get_origin(v) is NotRequired}
    return set(hints) - optional, optional


@pytest.mark.parametrize(
    ("typed", "serializer"),
    [
        (protocol.EnrollRequest, nodes_api.EnrollRequestSerializer),
        (protocol.EnrollResponse, nodes_api.EnrollResponseSerializer),
        (protocol.Hardware, nodes_api.HardwareSerializer),
        (protocol.GpuInfo, nodes_api.GpuSerializer),
        (protocol.ModelFileInfo, nodes_api.ModelFileInfoSerializer),
        (protocol.Heartbeat, nodes_api.HeartbeatSerializer),
        (protocol.HeartbeatResponse, nodes_api.HeartbeatResponseSerializer),
        (protocol.Report, nodes_api.ReportSerializer),
    ],
)
def test_serializer_fields_match_the_protocol_typeddict(typed: Any, serializer: Any) -> None:
    required, optional = keys(typed)
    fields = serializer().fields
    assert set(fields) == required | optional, (
        f"{typed.__name__}: {set(fields) ^ (required | optional)}"
    )
    for name, field in fields.items():
        if getattr(field, "read_only", False):
            continue
        assert field.required == (name in required), (
            f"{typed.__name__}.{name}: required={field.required}"
        )


def test_report_kinds_accepted_by_the_controller_are_the_protocols() -> None:
    kind = nodes_api.ReportSerializer().fields["kind"]
    assert isinstance(kind, serializers.ChoiceField)
    assert set(kind.choices) == set(protocol.REPORT_KINDS)
    from typing import get_args

    assert set(get_args(protocol.ReportKind)) == set(protocol.REPORT_KINDS)
    assert set(get_args(protocol.CommandKind)) == set(protocol.COMMAND_KINDS)


def test_every_command_the_controller_sends_is_a_protocol_command() -> None:
    import ast
    from pathlib import Path

    sent: set[str] = set()
    for path in Path(__file__).resolve().parents[2].joinpath("apps").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "command_send"
            ):
                for kw in node.keywords:
                    if kw.arg == "kind" and isinstance(kw.value, ast.Constant):
                        sent.add(str(kw.value.value))
    assert sent, "found no command_send calls"
    assert sent <= set(protocol.COMMAND_KINDS), sent - set(protocol.COMMAND_KINDS)


def test_a_sample_enrollment_from_the_agent_validates(tmp_path: Any) -> None:
    from agent.hardware import fake

    profile = tmp_path / "gpu.json"
    profile.write_text(
        __import__("json").dumps(
            fake.example_profile("gpu")
            if hasattr(fake, "example_profile")
            else {
                "cpu": {"model": "x", "physical_cores": 4, "logical_cores": 8, "flags": []},
                "memory": {"total": 1, "available": 1},
                "swap": {"total": 0, "free": 0},
                "disk": {"path": "/", "total": 1, "free": 1},
                "network": [],
                "gpus": [],
            }
        )
    )
    body = {
        "token": "t",
        "node_name": "n1",
        "machine_id": "m",
        "agent_version": "0.1.0",
        "protocol_version": PROTOCOL_VERSION,
        "advertise_address": "10.1.2.3",
        "rpc_port": 50052,
        "hardware": __import__("json").loads(profile.read_text()),
    }
    s = nodes_api.EnrollRequestSerializer(data=body)
    assert s.is_valid(), s.errors
