"""Typed ids (issue 29): which entity's id a string is.

The controller's rows have UUID primary keys, and an id crosses into Redis keys, commands and the
agent protocol as text. A function that takes a ``NodeId`` cannot be handed a job's id, or a
UUID object that a later ``str()`` would have had to remember: the id is converted once, at the
boundary (a row, a request, a report), with the functions below, which also refuse anything that
is not a UUID.
"""

from __future__ import annotations

from typing import NewType
from uuid import UUID

NodeId = NewType("NodeId", str)
JobId = NewType("JobId", str)
DeploymentId = NewType("DeploymentId", str)
AccountId = NewType("AccountId", str)
ModelId = NewType("ModelId", str)
ApiKeyId = NewType("ApiKeyId", str)


def _canonical(value: UUID | str, what: str) -> str:
    try:
        return str(value if isinstance(value, UUID) else UUID(str(value)))
    except ValueError:
        raise ValueError(f"not a {what} id: {value!r}") from None


def node_id(value: UUID | str) -> NodeId:
    return NodeId(_canonical(value, "node"))


def job_id(value: UUID | str) -> JobId:
    return JobId(_canonical(value, "job"))


def deployment_id(value: UUID | str) -> DeploymentId:
    return DeploymentId(_canonical(value, "deployment"))


def account_id(value: UUID | str) -> AccountId:
    return AccountId(_canonical(value, "account"))


def model_id(value: UUID | str) -> ModelId:
    return ModelId(_canonical(value, "model"))


def api_key_id(value: UUID | str) -> ApiKeyId:
    return ApiKeyId(_canonical(value, "API key"))


def as_uuid(value: UUID | str) -> UUID:
    """The id as a UUID, for an ORM lookup (django-stubs types a UUID primary key's lookups so)."""
    return value if isinstance(value, UUID) else UUID(value)
