"""One shared cluster for the reliability suite, and its summary table."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.launcher.harness import wait_for

from .harness import READY_TIMEOUT, Cluster, Result, start_cluster, stop_cluster, table

RESULTS = pytest.StashKey[list[Result]]()
SUMMARY_PATH = pytest.StashKey[Path]()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The launcher with 2 agents and SmolLM2 on 2 replicas (one per agent); stopped, with every
    process it started, at the module's end, failure or not."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # thousands of polls: not in the output
    var = tmp_path_factory.mktemp("reliability") / "var"
    la, env = start_cluster(var)
    try:
        la.wait_log(r"\[racon\] ready", READY_TIMEOUT)
        secrets = {k: v for k, v in la.secrets().items() if v}
        redis_port = la.wait_log(r"embedded Redis on 127\.0\.0\.1:(\d+)", 10).group(1)
        password = quote(secrets["RACON_REDIS_PASSWORD"], safe="")
        manage_env = {
            **env,
            **secrets,
            "REDIS_URL": f"redis://:{password}@127.0.0.1:{redis_port}/0",
        }
        c = Cluster(launcher=la, model="", api_key=secrets["AI_API_KEY"], env=manage_env)
        c.model = c.get("/api/admin/models")[0]["name"]
        # The launcher deploys one replica; a second, once the first is placed, goes to the other
        # node (one replica per node).
        wait_for(c.serving, READY_TIMEOUT, "the launcher's deployment to be READY", interval=1.0)
        resp = c.post("/api/admin/deployments", {"model": c.model})
        assert resp.status_code == 202, resp.text
        c.wait_replicas(timeout=READY_TIMEOUT)
        for _ in range(4):  # warm: both replicas have served before the first kill
            assert c.stream(max_tokens=8).ok
        yield c
    except BaseException:
        print(f"\n--- launcher log (tail) ---\n{la.log()[-6000:] if la.log_path.exists() else ''}")
        raise
    finally:
        stop_cluster(la)


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Result]]:
    """Each scenario's figures; at the module's end, the table is printed and written to a file."""
    rows: list[Result] = []
    yield rows
    text = table(rows)
    path = tmp_path_factory.mktemp("reliability-summary") / "summary.txt"
    path.write_text(text)
    request.config.stash[RESULTS] = rows
    request.config.stash[SUMMARY_PATH] = path
    print(f"\n{text}\n[reliability] summary written to {path}")


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """The table, shown without -s as well (make test)."""
    rows = config.stash.get(RESULTS, None)
    if not rows:
        return
    terminalreporter.section("reliability: kill -9 under 8 concurrent streams")
    terminalreporter.write(table(rows))
    terminalreporter.write_line(f"written to {config.stash[SUMMARY_PATH]}")
