"""Errors the agent-facing API answers, raised by services of this app or of higher ones."""

from __future__ import annotations


class ReportRefused(Exception):
    """A node's report was refused: it is not the node the controller's record names.

    ``code`` is machine-readable (``not_plan_member``, ``not_command_node``, ``unknown_command``).
    It lives here, below apps.jobs, so the reports endpoint in this app can answer it without
    importing the jobs app that raises it.
    """

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code
