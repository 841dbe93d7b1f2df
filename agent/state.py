"""The agent's own state, its exit codes and the errors that end it or refuse a command."""

from __future__ import annotations

from enum import StrEnum

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_REFUSED = 3  # revoked, or the controller refused the enrollment token / credential


class AgentState(StrEnum):
    """What the agent tells the controller it is; the agent alone moves it (Agent.set_state)."""

    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    DRAINING = "DRAINING"
    ERROR = "ERROR"


class FatalAgentError(Exception):
    """The agent cannot go on. refused: the controller refused this node, so nothing more can
    be reported to it (no drain report, no last heartbeat)."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR, *, refused: bool = False) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.refused = refused


class CommandError(Exception):
    """A command this node refuses; becomes command_result {ok: false, error} (and ``code``,
    machine-readable, when set)."""

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code
