"""Structured logging: JSON lines in production, readable text in development.

The context (request id, job id, node id, deployment id) travels in a contextvar so every log
line emitted while handling one request or task carries it without threading it through calls.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CONTEXT_FIELDS = ("request_id", "job_id", "node_id", "deployment_id")
# The default is never mutated: every change sets a new dict.
_context: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar(
    "racon_log_context",
    default={},  # noqa: B039
)


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Bind fields (request_id, job_id, node_id, deployment_id) to every log line in this block."""
    merged = {**_context.get(), **{k: str(v) for k, v in fields.items() if v is not None}}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current context (until the enclosing log_context ends)."""
    _context.set({**_context.get(), **{k: str(v) for k, v in fields.items() if v is not None}})


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(
            f"{k}={getattr(record, k)}"
            for k in CONTEXT_FIELDS
            if getattr(record, k, None) is not None
        )
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if ctx:
            line += f" [{ctx}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class HealthProbeFilter(logging.Filter):
    """django.request logs a 503 of /health at ERROR; during start every poll gets one (the
    launcher waits on it). Lower those records to DEBUG (shown only when the root logger is at
    DEBUG): a failing health check is not an error of the request, and its body says what is down."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and getattr(record, "status_code", None) == 503:
            request = getattr(record, "request", None)
            if getattr(request, "path", "") == "/health":
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
                return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True
