"""Fixtures for agent tests. No Django anywhere: the agent must work without the controller's stack.

The controller is played by a small real HTTP server (FakeController) speaking the wire contract
in agent/protocol.py; Redis is the real one on 127.0.0.1:6379, database 15, and every key a test
creates is namespaced by a fresh node id and deleted afterwards. The fixtures are defined in
tests/agent/harness.py, so that tests elsewhere (tests/observability) can use them too.
"""

from __future__ import annotations

from tests.agent.harness import (  # noqa: F401 - the fixtures
    controller,
    h,
    job_id,
    node_id,
    redis_client,
)
