from __future__ import annotations

import subprocess
import sys

import agent
from tests.agent.harness import REPO


def test_importing_the_agent_loads_no_django() -> None:
    code = (
        "import sys\n"
        "import agent, agent.cli, agent.agent, agent.queue, agent.client, agent.hardware\n"
        "import agent.runtime.primary, agent.runtime.rpc_worker, agent.runtime.fake\n"
        "import agent.runtime.server, agent.runtime.rpc_worker_main, agent.runtime.llama\n"
        "import agent.commands, agent.dispatcher, agent.heartbeat, agent.lifecycle, agent.metrics\n"
        "import agent.outbox, agent.redis_link, agent.registry, agent.retry, agent.state\n"
        "bad = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))\n"
        "print('DJANGO' if bad else 'CLEAN', bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CLEAN"), out.stdout


def test_agent_package_has_a_version() -> None:
    assert agent.__version__.count(".") == 2
